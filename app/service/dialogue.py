"""Dialogue scripts: one take spoken by several saved voices, turn by turn. Design notes: docs/design.md."""

from __future__ import annotations

import re
from dataclasses import dataclass

from app.message import Message
from app.model.tokenizer import SPECIAL_TOKENS
from app.service.inputs import InputError, speakable
from app.service.voices import NAME_RE

# a speaker tag: a voice name in brackets (NAME_RE's characters); the model's own tags are told apart below
TAG_RE = re.compile(rf"\[({NAME_RE.pattern})\]")
MODEL_TAGS = frozenset(t[1:-1] for t in SPECIAL_TOKENS if t.startswith("[") and t.endswith("]"))
SYNTAX = "[name] text [other] text …, each name a saved voice"


@dataclass(frozen=True)
class ScriptTurn:
    """One turn of a script: `speaker` is a saved voice's name, "" for text before the first tag."""

    speaker: str
    text: str


def parse_script(script: str) -> list[ScriptTurn]:
    """The turns of a (cleaned) script, in order; `InputError` (code "invalid_dialogue") when it has no
    speaker tag, or a turn has nothing to say."""
    turns: list[ScriptTurn] = []
    speaker, start = "", 0
    for m in TAG_RE.finditer(script):
        if m.group(1).lower() in MODEL_TAGS:
            continue
        turns.append(ScriptTurn(speaker, script[start:m.start()].strip()))
        speaker, start = m.group(1), m.end()
    turns.append(ScriptTurn(speaker, script[start:].strip()))
    lead, turns = turns[0], turns[1:]
    if not turns:
        raise InputError(Message("no_tags", "A dialogue needs speaker tags: write {syntax}.", syntax=SYNTAX), "text",
                         code="invalid_dialogue")
    for i, turn in enumerate(turns, 1):
        if not speakable(turn.text):
            raise InputError(Message("turn_empty", "Turn {i} ([{speaker}]) has nothing to say: write its words after "
                                     "the tag, or remove the tag.", i=i, speaker=turn.speaker), "text",
                             code="invalid_dialogue")
    return ([lead] if speakable(lead.text) else []) + turns


def speakers(turns: list[ScriptTurn], limit: int) -> list[str]:
    """The distinct speakers of `turns` (first appearance order, without the lead's ""); `InputError` when
    more than `limit` ([limits] max_dialogue_speakers)."""
    names = list(dict.fromkeys(t.speaker for t in turns if t.speaker))
    if len(names) > limit:
        raise InputError(Message("too_many_speakers", "The dialogue has {n} speakers; the limit is {limit} ([limits] "
                                 "max_dialogue_speakers).", n=len(names), limit=limit), "text", code="invalid_dialogue")
    return names
