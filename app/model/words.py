"""Words as a listener reads them, and which of them each token's time belongs to (pure text, no model).

    split_words("Hello there, 今天好。")  # spans of "Hello", "there,", "今", "天", "好。"

Design notes: docs/timings.md.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# each character of these scripts is a word (zh/ja are written without spaces); Hangul is spaced, so not here
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002ffff"
_WIDE = "\u3000-\u303f\uff00-\uffef"  # CJK punctuation and full-width forms: a piece of their own ("，OK" is 2)
# one CJK character, a run of wide forms, or a run of anything else but spaces
_PIECE = re.compile(rf"[{_CJK}]|[{_WIDE}]+|[^\s{_CJK}{_WIDE}]+")
_HAS_WORD = re.compile(r"\w")  # a piece without a letter or digit is punctuation: it joins a neighbour


@dataclass(frozen=True)
class WordSpan:
    text: str  # the word with its attached punctuation, as written
    start_char: int  # [start_char, end_char) in the sentence's text
    end_char: int


def split_words(text: str) -> list[WordSpan]:
    """The words of `text`: whitespace-separated runs, and each CJK character its own word.

    Punctuation joins the word before it ("there," "好。"), or the word after it at the start of the text
    ("“Hi"); a text of punctuation only is one word.
    """
    spans: list[list[int]] = []  # [start, end) per word
    pending_start = -1  # leading punctuation waiting for its word
    for m in _PIECE.finditer(text):
        if _HAS_WORD.search(m.group()):
            spans.append([m.start() if pending_start < 0 else pending_start, m.end()])
            pending_start = -1
        elif spans:
            spans[-1][1] = m.end()
        elif pending_start < 0:
            pending_start = m.start()
    if pending_start >= 0:  # punctuation only (a word would have taken it)
        spans = [[pending_start, len(text.rstrip())]]
    return [WordSpan(text[a:b], a, b) for a, b in spans]


def language_of(text: str) -> str:
    """Whisper's language code guessed from the script: kana -> ja, Han -> zh, Hangul -> ko, else en."""
    if re.search("[\u3040-\u30ff]", text):
        return "ja"
    if re.search(f"[{_CJK}]", text):
        return "zh"
    if re.search("[\uac00-\ud7af]", text):
        return "ko"
    return "en"


def word_frames(words: Sequence[WordSpan], token_chars: Sequence[tuple[int, int]],
                token_frames: np.ndarray) -> np.ndarray:
    """Each word's [start, end) in (fractional) frames from its tokens' frames -> [W, 2] float64, NaN if none.

    token_chars: [T] (start, end) character span of each token in the text; token_frames: [T, 2] float
    [start, end) of each token. A token spanning several characters shares its frames among them evenly
    (a Han character split over 3 byte tokens takes the union of the 3; two characters merged in one token
    take half each); a word spans its characters' times. Space-only tokens belong to no word.
    """
    n_chars = max((b for _, b in token_chars), default=0)
    char_lo = np.full(n_chars, np.inf)  # [C] earliest start of any token share on the character
    char_hi = np.full(n_chars, -np.inf)  # [C] latest end
    for (a, b), (s, e) in zip(token_chars, token_frames, strict=True):
        if b <= a:
            continue
        edges = s + (e - s) * np.arange(b - a + 1) / (b - a)  # [b - a + 1] equal shares
        char_lo[a:b] = np.minimum(char_lo[a:b], edges[:-1])
        char_hi[a:b] = np.maximum(char_hi[a:b], edges[1:])
    out = np.full((len(words), 2), np.nan)
    for i, w in enumerate(words):
        lo, hi = char_lo[w.start_char:w.end_char], char_hi[w.start_char:w.end_char]
        if np.isfinite(lo).any():
            out[i] = lo[np.isfinite(lo)].min(), hi[np.isfinite(hi)].max()
    return out


def char_edges_ms(start_ms: int, end_ms: int, n_chars: int) -> list[int]:
    """[n_chars + 1] integer ms edges sharing [start_ms, end_ms] evenly among `n_chars` characters."""
    return [start_ms + round((end_ms - start_ms) * k / max(1, n_chars)) for k in range(n_chars + 1)]
