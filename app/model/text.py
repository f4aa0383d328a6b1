"""Text normalisation and segment splitting of the CosyVoice2 frontend (`text_normalize`).

Design notes: docs/model.md.
"""

from __future__ import annotations

import logging
import re
import threading
import unicodedata
from collections.abc import Callable
from typing import Literal, overload

TextBackend = Literal["wetext", "none"]

# split_paragraph settings of the official text_normalize
TOKEN_MAX_N = 80  # a segment stops growing past this length (zh: chars, en: Qwen tokens) ...
TOKEN_MIN_N = 60  # ... once it is already longer than this
MERGE_LEN = 20  # a final remainder shorter than this joins the previous segment
ZH_SENTENCE_END = ("。", "？", "！", "；", "：", "、", ".", "?", "!", ";")
EN_SENTENCE_END = (".", "?", "!", ";", ":")
COMMAS = ("，", ",")  # extra split points with comma_split=True (unused by text_normalize)
CLOSING_QUOTES = ('"', "”")  # a quote right after a sentence end stays with that sentence

_CJK = re.compile(r"[\u4e00-\u9fff]")
_TRAILING_COMMAS = re.compile(r"[，,、]+$")


def contains_chinese(text: str) -> bool:
    """True if any char is a CJK unified ideograph (U+4E00..U+9FFF): the zh/en switch."""
    return _CJK.search(text) is not None


def is_only_punctuation(text: str) -> bool:
    """True if every char is Unicode punctuation (P*) or symbol (S*); True for ''."""
    return all(unicodedata.category(c)[0] in "PS" for c in text)


def replace_blank(text: str) -> str:
    """Drop every space except one between two ASCII non-space chars (e.g. between English words).

    Like the official rule, the left neighbour of a leading space is the text's last char (Python
    index -1); a trailing space, where the official code raises IndexError, is dropped.
    """
    out = []
    for i, c in enumerate(text):
        if c == " ":
            prev, nxt = text[i - 1], text[i + 1] if i + 1 < len(text) else " "
            if prev.isascii() and prev != " " and nxt.isascii() and nxt != " ":
                out.append(c)
        else:
            out.append(c)
    return "".join(out)


def zh_cleanup(text: str) -> str:
    """The official post-TN replacements for zh text, in their order."""
    text = replace_blank(text.replace("\n", ""))
    text = text.replace("²", "平方").replace("³", "立方")
    text = text.replace(".", "。").replace(" - ", "，")
    for bracket in ("（", "）", "【", "】", "`"):
        text = text.replace(bracket, "")
    text = text.replace("——", " ")
    return _TRAILING_COMMAS.sub("。", text)


def spell_out_numbers(text: str, number_to_words: Callable[[str], str]) -> str:
    """Replace each maximal run of `str.isdigit` chars (this includes e.g. '²') by its words."""
    out: list[str] = []
    start: int | None = None  # start index of the current digit run
    for i, c in enumerate(text):
        if c.isdigit():
            if start is None:
                start = i
            continue
        if start is not None:
            out.append(number_to_words(text[start:i]))
            start = None
        out.append(c)
    if start is not None:
        out.append(number_to_words(text[start:]))
    return "".join(out)


def split_paragraph(
    text: str,
    length: Callable[[str], int],
    lang: Literal["zh", "en"],
    *,
    token_max_n: int = TOKEN_MAX_N,
    token_min_n: int = TOKEN_MIN_N,
    merge_len: int = MERGE_LEN,
    comma_split: bool = False,
) -> list[str]:
    """Cut `text` after sentence punctuation, then greedily merge sentences into segments.

    `length` measures a piece (zh: `len`, en: Qwen token count). Quirks kept from the official
    code: a sentence end that follows another one directly is dropped ("Hi!!" -> "Hi!"); a
    closing quote after a sentence end joins the previous sentence; text not ending in sentence
    punctuation gets `。` (zh) / `.` (en) appended first. `text` must not be empty.
    """
    ends = ZH_SENTENCE_END if lang == "zh" else EN_SENTENCE_END
    if comma_split:
        ends = ends + COMMAS
    if text[-1] not in ends:
        text += "。" if lang == "zh" else "."

    sentences: list[str] = []
    start = 0
    for i, c in enumerate(text):
        if c not in ends:
            continue
        if i > start:
            sentences.append(text[start:i] + c)
        if i + 1 < len(text) and text[i + 1] in CLOSING_QUOTES:
            if sentences:  # (the official code raises IndexError when there is none)
                sentences[-1] += text[i + 1]
            start = i + 2
        else:
            start = i + 1

    segments: list[str] = []
    current = ""
    for sentence in sentences:
        if length(current + sentence) > token_max_n and length(current) > token_min_n:
            segments.append(current)
            current = ""
        current += sentence
    if current:
        if segments and length(current) < merge_len:
            segments[-1] += current
        else:
            segments.append(current)
    return segments


class _WetextTN:
    """wetext 0.0.4 semantics on the FSTs of the installed wetext: tag -> reorder -> verbalize,
    only when the text has a digit, nothing stripped. The FSTs load on first use; calls are
    serialised because kaldifst's normalizer makes no thread-safety promise."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._normalizer = None

    def _load(self):
        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        try:
            from wetext import Normalizer  # its import calls logging.basicConfig(level=INFO)
        except ImportError as e:
            raise RuntimeError("text backend 'wetext' needs the wetext package (pip install wetext)") from e
        finally:  # undo that basicConfig so the app's logging set-up stays its own
            root.handlers[:] = handlers
            root.setLevel(level)
        # 0.0.4's Normalizer(remove_erhua=False) and Normalizer() are both this (auto, tn, erhua kept)
        normalizer = Normalizer(lang="auto", operator="tn", remove_erhua=False)
        if not (hasattr(normalizer, "taggers") and hasattr(normalizer, "verbalizers")):
            raise RuntimeError("unsupported wetext version: Normalizer has no taggers/verbalizers")
        return normalizer

    def __call__(self, text: str, lang: Literal["zh", "en"]) -> str:
        if re.search(r"\d", text) is None:  # 0.0.4: TN only runs on text with a digit
            return text
        with self._lock:
            if self._normalizer is None:
                self._normalizer = self._load()
            n = self._normalizer
            tagged = n.taggers[lang](text)
            return n.verbalizers[lang](n.reorder(tagged, lang))


class TextFrontend:
    """The official `text_normalize`: bypass rules, zh/en normalisation and segment splitting.

    `count_tokens` is the tokenizer's `encode` length (English segment lengths are in tokens).
    One instance is safe to share across threads; wetext and inflect load on first use.
    """

    def __init__(self, backend: TextBackend, count_tokens: Callable[[str], int]) -> None:
        if backend not in ("wetext", "none"):
            raise ValueError(f"text backend must be 'wetext' or 'none', got {backend!r}")
        self.backend: TextBackend = backend
        self.count_tokens = count_tokens
        self._tn = _WetextTN() if backend == "wetext" else None
        self._inflect_lock = threading.Lock()  # inflect's engine keeps state during number_to_words
        self._inflect = None

    def warmup(self) -> None:
        """Load wetext's FSTs and inflect now (importing inflect alone takes seconds) instead of
        on the first request."""
        if self._tn is not None:
            self._tn("1", "en")  # loads the zh and en FSTs together
        self._number_to_words("1")

    def _number_to_words(self, digits: str) -> str:
        import inflect

        with self._inflect_lock:
            if self._inflect is None:
                self._inflect = inflect.engine()
            try:
                return self._inflect.number_to_words(digits)
            except inflect.NumOutOfRangeError:  # > ~10^36; the official code raises here
                return " ".join(self._inflect.number_to_words(d) for d in digits)

    @overload
    def normalize(self, text: str, *, split: Literal[True] = ..., text_frontend: bool = ...) -> list[str]: ...
    @overload
    def normalize(self, text: str, *, split: Literal[False], text_frontend: bool = ...) -> str: ...
    @overload
    def normalize(self, text: str, *, split: bool, text_frontend: bool = ...) -> list[str] | str: ...

    def normalize(self, text: str, *, split: bool = True, text_frontend: bool = True) -> list[str] | str:
        """Normalise `text`; with `split` return its segments (each synthesised on its own), else
        the whole normalised string (used for prompt text). Bypassed text comes back unchanged
        (as a one-element list with `split`). Punctuation-only segments are dropped, so a split
        result may be empty."""
        if "<|" in text and "|>" in text:  # special tokens present: leave the text alone
            text_frontend = False
        if not text_frontend or text == "":
            return [text] if split else text
        text = text.strip()
        if contains_chinese(text):
            lang: Literal["zh", "en"] = "zh"
            if self._tn is not None:
                text = self._tn(text, "zh")
            text = zh_cleanup(text)
        else:
            lang = "en"
            if self._tn is not None:
                text = self._tn(text, "en")
            text = spell_out_numbers(text, self._number_to_words)
        if not split:
            return text
        if text == "":  # whitespace-only input (the official code raises IndexError here)
            return []
        length = len if lang == "zh" else self.count_tokens
        segments = split_paragraph(text, length, lang)
        return [s for s in segments if not is_only_punctuation(s)]
