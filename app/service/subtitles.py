"""A take's word timings as subtitles: SRT and WebVTT cues of a few words each, never across a sentence's end.

    to_srt(timings.words)  # "1\\n00:00:00,120 --> 00:00:01,840\\nHello there, how are you\\n\\n2\\n..."
    to_vtt(timings.words)  # "WEBVTT\\n\\n00:00:00.120 --> 00:00:01.840\\nHello there, how are you\\n\\n..."

Design notes: docs/timings.md.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from app.service.timings import WordTiming

MAX_CUE_CHARS = 42  # one subtitle line's usual limit (broadcast guidelines): longer runs start a new cue
MAX_CUE_MS = 6_000  # a cue is read in this long at most
_SENTENCE_END = re.compile(r"[.!?。！？…]['\"”’」』)）]*$")  # a word ending its sentence closes the cue
_CJK_EDGE = re.compile("[\u3000-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\uffef]")  # no space beside these


@dataclass(frozen=True)
class Cue:
    start_ms: int
    end_ms: int
    text: str  # one line, whitespace collapsed


def cues(words: Sequence[WordTiming]) -> list[Cue]:
    """`words` (monotone, as a TakeTimings gives them) grouped into cues: a new cue after a sentence's last word,
    and before a word that would make the cue longer than MAX_CUE_CHARS or MAX_CUE_MS."""
    out: list[Cue] = []
    group: list[WordTiming] = []
    for w in words:
        if group and (len(_join([*group, w])) > MAX_CUE_CHARS or w.end_ms - group[0].start_ms > MAX_CUE_MS):
            out.append(_cue(group))
            group = []
        group.append(w)
        if _SENTENCE_END.search(w.word):
            out.append(_cue(group))
            group = []
    if group:
        out.append(_cue(group))
    return out


def to_srt(words: Sequence[WordTiming]) -> str:
    """SubRip: numbered cues, `HH:MM:SS,mmm --> HH:MM:SS,mmm`, a blank line after each."""
    return "".join(f"{i}\n{_stamp(c.start_ms, ',')} --> {_stamp(c.end_ms, ',')}\n{c.text}\n\n"
                   for i, c in enumerate(cues(words), 1))


def to_vtt(words: Sequence[WordTiming]) -> str:
    """WebVTT: the `WEBVTT` header, then cues `HH:MM:SS.mmm --> HH:MM:SS.mmm` with &, <, > escaped."""
    body = "".join(f"{_stamp(c.start_ms, '.')} --> {_stamp(c.end_ms, '.')}\n{_escape(c.text)}\n\n"
                   for c in cues(words))
    return "WEBVTT\n\n" + body


def _join(group: Sequence[WordTiming]) -> str:
    """Words as read: a space between two words unless one side is CJK (zh/ja words are characters)."""
    text = ""
    for w in group:
        word = " ".join(w.word.split())
        text += word if not text or _CJK_EDGE.match(word[:1]) or _CJK_EDGE.match(text[-1]) else " " + word
    return text.replace("-->", "->")  # the arrow would read as a timing line


def _cue(group: Sequence[WordTiming]) -> Cue:
    return Cue(group[0].start_ms, max(group[0].start_ms, group[-1].end_ms), _join(group))


def _stamp(ms: int, sep: str) -> str:
    h, rest = divmod(max(0, ms), 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, milli = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{milli:03d}"


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
