"""A take as the page names and describes it: its WAV's file name and the stats line under both players."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

from app.audio import OUTPUT_SAMPLE_RATE_HZ
from app.ui.i18n import labels, say, t

NAME_WORDS, NAME_CHARS = 6, 40  # the final WAV's file name: at most this many words / characters (player.js too)
WORD_RE = re.compile(r"[^\W_]+")


def wav_name(text: str, voice: str | None = None) -> str:
    """"alice-hello-there-how-are-you.wav": the saved voice (if any) and the text's first words."""
    def words(t: str) -> list[str]:  # letters and digits of any script
        return WORD_RE.findall(unicodedata.normalize("NFKC", t or "").lower())

    stem = "-".join(words(text)[:NAME_WORDS])[:NAME_CHARS].rstrip("-") or "speech"
    prefix = "-".join(words(voice or ""))[:NAME_CHARS // 2].rstrip("-")
    return f"{prefix}-{stem}.wav" if prefix else f"{stem}.wav"


def stopped_take(request_id: str, seed: int | None, n_samples: int, mode: str | None = None) -> dict:
    """The details of a take ended by the page's Stop, either player's (`take_line` says it)."""
    return {"stopped": True, "seed": seed, **({"mode": mode} if mode else {}), "request_id": request_id,
            "sample_rate": OUTPUT_SAMPLE_RATE_HZ, "audio_samples": n_samples}


STATS_S = ("ttfa_ms", "tokens_per_s", "audio_s", "lm_s", "flow_s", "vocoder_s", "queue_wait_s", "reference_s")


def take_line(details: dict | None, lang: str, notes: Sequence[str] | None = None) -> str:
    """The stats line under both players in `lang`, from a take's details (RequestRecord.details(), a stopped
    take's, the low-latency player's `player` and `client`) and notes (the record's Messages; else the details'
    English ones); "" for none or a failed take. The language switch says it again from the details box."""
    d = details if isinstance(details, dict) and "request_id" in details else None
    if d is None:
        return ""
    mode = labels("zh").get(f"mode_{d.get('mode')}", d.get("mode")) if lang == "zh" else d.get("mode")
    if d.get("stopped"):
        parts = [t(lang, "stopped", seconds=d["audio_samples"] / d["sample_rate"]),
                 t(lang, "stopped_mode", mode=mode) if mode else "",
                 t(lang, "stopped_seed", seed=d["seed"]) if d.get("seed") is not None else ""]
        return " · ".join(p for p in parts if p)
    rtf = d["rtf"] if d.get("rtf") is not None else float("inf")  # None: no audio
    line = t(lang, "stats", **{k: d.get(k) or 0 for k in STATS_S}, rtf=rtf, mode=mode, seed=d.get("seed"))
    if d.get("player") == "webaudio":  # the low-latency player's own measures (ms since the click)
        ms = {k: (d.get("client") or {}).get(f"{k}_ms") for k in ("first_byte", "first_sound")}
        line += t(lang, "stats_player", **{k: "–" if v is None else t(lang, "ms", n=round(v)) for k, v in ms.items()})
    return line + notes_markdown([say(n, lang) for n in (d.get("notes") or () if notes is None else notes)])


def notes_markdown(notes: Sequence[str]) -> str:
    """The notes as a Markdown list below the stats line ("" for none)."""
    return "\n\n" + "\n".join(f"- {n}" for n in notes) if notes else ""
