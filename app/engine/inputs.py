"""Checks of user inputs shared by every way in (the page, its Gradio API, the HTTP API).

Each check returns the cleaned value or raises `InputError` with a message that says what to do.
The page turns it into a `gr.Error`, the HTTP API into an OpenAI-shaped 400 naming the field
(`InputError.param`). Limits are named constants here or settings in `[server]`.
"""

from __future__ import annotations

import re
import secrets
import unicodedata

from app.engine.requests import MODES

MAX_SEED = 2**31 - 1
MAX_INSTRUCT_CHARS = 500
MAX_TRANSCRIPT_CHARS = 1000  # a 30 s reference has ~150 words; more is not its transcript
SPEED_RANGE = (0.5, 2.0)
MAX_FIXED_TOKENS = 1500  # benchmark mode: 60 s of speech at 25 tokens/s (prompt + this must fit max_model_len)
ENDOFPROMPT = "<|endofprompt|>"
# the tokenizer's special tokens (<|endofprompt|>, <|im_start|>, ...): typed into the text or the
# transcript they would steer the LM (end the prompt early, fake an instruction), so they are removed
SPECIAL_TOKEN_RE = re.compile(r"<\|[^<>|\s]{1,40}\|>")


class InputError(ValueError):
    """A user input is unusable; `str(e)` says why and what to do, `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _strip_controls(s: str) -> str:
    """`s` without control characters (Cc/Cf: NUL, escapes, zero-width marks); newlines/tabs become spaces."""
    s = s.replace("\r\n", "\n").replace("\t", " ")
    return "".join(ch for ch in s if ch == "\n" or unicodedata.category(ch) not in ("Cc", "Cf"))


def check_text(text: object, limit: int, *, param: str = "input") -> str:
    """The text to speak: non-empty after stripping controls, at most `limit` characters."""
    if not isinstance(text, str):
        raise InputError(f"'{param}' must be a string", param)
    text = SPECIAL_TOKEN_RE.sub(" ", _strip_controls(text)).strip()
    if not text:
        raise InputError("Type the text to speak (it is empty or only control characters / special tokens).", param)
    if len(text) > limit:
        raise InputError(f"The text has {len(text)} characters; the limit is {limit}. Shorten it or split it.", param)
    return text


def check_mode(mode: object) -> str:
    if mode not in MODES:
        raise InputError(f"Unknown mode {mode!r}: use one of {', '.join(MODES)}.", "mode")
    return str(mode)


def check_instruct(instruct_text: object, mode: str) -> str:
    instruct_text = _strip_controls(str(instruct_text or "")).strip()
    if mode == "instruct" and not instruct_text.replace(ENDOFPROMPT, "").strip():
        raise InputError("Instruct mode needs an instruction, e.g. 'Speak slowly and calmly.'", "instruct_text")
    if len(instruct_text) > MAX_INSTRUCT_CHARS:
        raise InputError(f"The instruction is longer than {MAX_INSTRUCT_CHARS} characters.", "instruct_text")
    return instruct_text


def check_transcript(prompt_text: object) -> str:
    prompt_text = SPECIAL_TOKEN_RE.sub(" ", _strip_controls(str(prompt_text or ""))).strip()
    if len(prompt_text) > MAX_TRANSCRIPT_CHARS:
        raise InputError(f"The transcript has {len(prompt_text)} characters; a reference clip's transcript has at "
                         f"most {MAX_TRANSCRIPT_CHARS}. Give the words spoken in the clip.", "prompt_text")
    return prompt_text


def check_seed(seed: object) -> int:
    """None or -1: a random seed; else an integer in 0..MAX_SEED."""
    if seed is None:
        return secrets.randbelow(MAX_SEED + 1)
    try:
        value = float(seed)
    except (TypeError, ValueError) as e:
        raise InputError(f"The seed must be an integer, got {seed!r}.", "seed") from e
    if value != value or value in (float("inf"), float("-inf")) or value != int(value):
        raise InputError(f"The seed must be an integer, got {seed!r}.", "seed")
    if value < 0:
        if value == -1:
            return secrets.randbelow(MAX_SEED + 1)
        raise InputError(f"The seed must be between 0 and {MAX_SEED} (or -1 for a random one).", "seed")
    if value > MAX_SEED:
        raise InputError(f"The seed must be between 0 and {MAX_SEED} (or -1 for a random one).", "seed")
    return int(value)


def check_speed(speed: object, stream: bool) -> float:
    try:
        value = float(1.0 if speed is None else speed)
    except (TypeError, ValueError) as e:
        raise InputError(f"Speed must be a number between {SPEED_RANGE[0]} and {SPEED_RANGE[1]}.", "speed") from e
    if not SPEED_RANGE[0] <= value <= SPEED_RANGE[1]:  # also refuses NaN
        raise InputError(f"Speed must be between {SPEED_RANGE[0]} and {SPEED_RANGE[1]}, got {speed}.", "speed")
    if stream and value != 1.0:
        raise InputError("Speed works only without streaming: turn streaming off or set speed to 1.0.", "speed")
    return value


def check_fixed_tokens(n: object) -> int:
    """Benchmark mode: exactly `n` speech tokens per text segment (stop tokens ignored); 0 = off."""
    if n is None:
        return 0
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_FIXED_TOKENS:
        raise InputError(f"fixed_tokens must be an integer in 0..{MAX_FIXED_TOKENS} (0 = off).", "fixed_tokens")
    return n
