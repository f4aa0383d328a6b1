"""Checks of user inputs shared by every way in (the page, its Gradio API, the HTTP API).
Design notes: docs/design.md."""

from __future__ import annotations

import re
import secrets
import unicodedata

from app.engine.requests import MODES
from app.message import Message

MAX_SEED = 2**31 - 1
SPEED_RANGE = (0.5, 2.0)
# the tokenizer's special tokens (<|endofprompt|>, <|im_start|>, ...): typed into the text, the
# transcript or the instruction they would steer the LM (end the prompt early, fake an instruction),
# so they are removed; the pipeline appends the one <|endofprompt|> an instruction needs itself.
# CosyVoice2's bracket tags ([breath], [laughter], <strong>...</strong>) are meant for users and stay.
SPECIAL_TOKEN_RE = re.compile(r"<\|[^<>|\s]{1,40}\|>")
# a "<|" or "|>" left over (e.g. "<|a b|>") would still switch the text normaliser off (app/model/text.py)
SPECIAL_MARK_RE = re.compile(r"(?<=<)\||\|(?=>)")
# dropped: control (Cc), format (Cf: zero-width marks, bidi overrides) and lone surrogates (Cs: the
# tokenizer cannot encode them)
_DROPPED_CATEGORIES = ("Cc", "Cf", "Cs")


class InputError(ValueError):
    """A user input is unusable; `str(e)` says why and what to do, `param` names the field (app/service/prepare.py's
    names: text, voice, reference, prompt_text, ...; each door maps them to its own), `code` the kind."""

    def __init__(self, message: str, param: str | None = None, *, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


def _shown(value: object) -> str:
    """`repr(value)` cut to 40 characters (an int of over 4300 digits cannot even be printed)."""
    try:
        return repr(value)[:40]
    except ValueError:
        return f"a {type(value).__name__} too long to show"


def clean_text(s: str) -> str:
    """User text as the model may see it: controls stripped (tabs become spaces, CRLF becomes LF), special
    tokens and their marks removed, trimmed."""
    s = s.replace("\r\n", "\n").replace("\t", " ")
    s = "".join(ch for ch in s if ch == "\n" or unicodedata.category(ch) not in _DROPPED_CATEGORIES)
    return SPECIAL_MARK_RE.sub(" ", SPECIAL_TOKEN_RE.sub(" ", s)).strip()


def speakable(s: str) -> bool:
    """True when `s` has a letter or a digit (any script); punctuation, symbols and emoji alone are not read."""
    return any(unicodedata.category(ch)[0] in "LN" for ch in s)


def check_text(text: object, limit: int, *, param: str = "input") -> str:
    """The text to speak: controls and special tokens removed, something speakable, at most `limit` characters."""
    if not isinstance(text, str):
        raise InputError(f"'{param}' must be a string", param)
    text = clean_text(text)
    if not text:
        raise InputError(Message("text_empty", "Type the text to speak (it is empty or only control characters / "
                                 "special tokens)."), param)
    if len(text) > limit:
        raise InputError(Message("text_too_long", "The text has {n} characters; the limit is {limit}. Shorten it or "
                                 "split it.", n=len(text), limit=limit), param)
    if not speakable(text):
        raise InputError(Message("text_unspeakable", "The text has nothing speakable (only punctuation, symbols or "
                                 "emoji): type some words."), param)
    return text


def check_mode(mode: object) -> str:
    if mode not in MODES:
        raise InputError(f"Unknown mode {mode!r}: use one of {', '.join(MODES)}.", "mode")
    return str(mode)


def check_instruct(instruct_text: object, mode: str, limit: int) -> str:
    """The instruction without special tokens (the pipeline appends <|endofprompt|>); needed in instruct mode."""
    instruct_text = clean_text(str(instruct_text or ""))
    if mode == "instruct" and not speakable(instruct_text):
        raise InputError(Message("no_instruction", "Instruct mode needs an instruction, e.g. 'Speak slowly and "
                                 "calmly.'"), "instruct_text")
    if len(instruct_text) > limit:
        raise InputError(Message("instruction_too_long", "The instruction has {n} characters; the limit is {limit}.",
                                 n=len(instruct_text), limit=limit), "instruct_text")
    return instruct_text


def check_transcript(prompt_text: object, limit: int) -> str:
    """The reference's transcript; "" (cross-lingual fallback) when it has nothing speakable."""
    prompt_text = clean_text(str(prompt_text or ""))
    if len(prompt_text) > limit:
        raise InputError(Message("transcript_too_long", "The transcript has {n} characters; a reference clip's "
                                 "transcript has at most {limit}. Give the words spoken in the clip.",
                                 n=len(prompt_text), limit=limit), "prompt_text")
    return prompt_text if speakable(prompt_text) else ""


def check_seed(seed: object) -> int:
    """None or -1: a random seed; else an integer in 0..MAX_SEED."""
    seed = -1 if seed is None else seed
    bad = InputError(Message("bad_seed", "The seed must be an integer between 0 and {max} (or -1 for a random one), "
                             "got {got}.", max=MAX_SEED, got=_shown(seed)), "seed")
    try:  # ints stay exact (a float of 10**400 overflows); 3.0 and "3" are fine, 3.5 and "x" are not
        value = seed if isinstance(seed, int) else float(seed)
    except (TypeError, ValueError, OverflowError) as e:
        raise bad from e
    # NaN and inf are no integer (and fail the range too)
    if isinstance(seed, bool) or (isinstance(value, float) and not value.is_integer()) or not -1 <= value <= MAX_SEED:
        raise bad
    return secrets.randbelow(MAX_SEED + 1) if value == -1 else int(value)


def check_speed(speed: object, stream: bool) -> float:
    try:
        value = float(1.0 if speed is None else speed)
    except (TypeError, ValueError, OverflowError) as e:
        raise InputError(f"Speed must be a number between {SPEED_RANGE[0]} and {SPEED_RANGE[1]}.", "speed") from e
    if not SPEED_RANGE[0] <= value <= SPEED_RANGE[1]:  # also refuses NaN
        raise InputError(f"Speed must be between {SPEED_RANGE[0]} and {SPEED_RANGE[1]}, got {_shown(speed)}.",
                         "speed")
    if stream and value != 1.0:
        raise InputError(Message("speed_needs_no_stream", "Speed works only without streaming: turn streaming off or "
                                 "set speed to 1.0."), "speed")
    return value


def check_fixed_tokens(n: object, limit: int) -> int:
    """Benchmark mode: exactly `n` speech tokens per text segment (stop tokens ignored); 0 = off."""
    if n is None:
        return 0
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= limit:
        raise InputError(f"fixed_tokens must be an integer in 0..{limit} (0 = off).", "fixed_tokens")
    return n
