"""One preparation for every way in: the page, its Gradio API, `/studio/speech`, `/v1/audio/speech` and the sockets.
Design notes: docs/design.md."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from app.audio import AudioError
from app.engine.requests import SynthesisRequest, Turn
from app.message import Message, said, said_without
from app.model.frontend import PromptAudioError, VoiceFeatures
from app.service import dialogue, inputs
from app.service.asr import AsrUnavailable
from app.service.inputs import InputError
from app.service.owners import ANYONE, Owner
from app.service.voices import VoiceError

NO_TRANSCRIPT_NOTE = Message("no_transcript", "no transcript: used cross-lingual mode (the voice without its words)")
NO_REFERENCE = Message("no_reference", "Upload or record a reference clip, or pick a saved voice.")
HEARD_NOTHING_NOTE = Message("heard_nothing", "Whisper heard no words in the reference: type its transcript")


@dataclass(frozen=True)
class SpeechInputs:
    """A synthesis as a door received it, not yet checked (values may be of any type)."""

    text: object = ""
    voice: str | None = None  # a saved voice's name; else `reference` + `transcript`
    # the reference clip: a path, its bytes, or a door's own lookup returning one (called after the checks)
    reference: str | Path | bytes | Callable[[], Path] | None = None
    transcript: object = None
    mode: object = None  # None: instruct when `instruct_text` is given, else zero_shot
    instruct_text: object = None
    seed: object = None  # None or -1: a random one
    speed: object = 1.0
    stream: bool | None = True  # None: stream unless speed != 1.0 (speed needs the whole utterance)
    fixed_tokens: object = 0
    owner: Owner = ANYONE  # whose saved voices `voice` names (app/service/owners.py)
    dialogue: bool = False  # `text` is a script of turns, `[name] …`, each a saved voice (app/service/dialogue.py)
    text_streams: bool = False  # a socket's start: the text arrives after it (app/engine/bistream.py), none to check


@dataclass(frozen=True)
class Prepared:
    """A checked request and what the door may show about it."""

    request: SynthesisRequest
    notes: tuple[str, ...]  # the reference checks' notes (trimmed, clipped), fallbacks taken
    voice_name: str  # "" for a reference clip
    reference_s: float  # seconds spent getting the voice's features (0 for a cached or saved voice: fast)
    owner: str = ""  # who asked (`Owner.id`): the page's panels show a caller their own requests


SHOWN_NAMES = 10  # voice names an unknown-speaker message lists at most


async def load_voice(service, name: str, owner: Owner = ANYONE, *, param: str = "voice") -> VoiceFeatures:
    """`owner`'s saved voice `name`, or `InputError(param, code="voice_not_found")` (param "text": a dialogue's
    speaker tag names it; the message, read on the page and over HTTP, lists the voices there are)."""
    store = service.voices.of(owner)
    try:
        return await asyncio.to_thread(store.load, name)
    except VoiceError as e:
        if param != "text":
            raise InputError(Message("voice_not_found", "{error}; pick a saved voice (GET /v1/voices lists them) or "
                                     "upload a reference clip", error=e), param, code="voice_not_found") from e
        names = sorted(await asyncio.to_thread(store.names))
        shown = ", ".join(names[:SHOWN_NAMES]) + (", …" if len(names) > SHOWN_NAMES else "")
        raise InputError(Message("unknown_speaker", "Unknown speaker [{name}]: there is no saved voice named {name}; "
                                 "save a voice named {name} first, or use one of: {shown}.", name=name, shown=shown)
                         if names else
                         Message("unknown_speaker_none", "Unknown speaker [{name}]: there is no saved voice named "
                                 "{name}; save a voice named {name} first (no voices are saved yet).", name=name),
                         param, code="voice_not_found") from e


async def reference_voice(service, reference: str | Path | bytes, transcript: object, *,
                          transcribe: bool = True) -> VoiceFeatures:
    """A reference clip's features (cached by content + transcript), or `InputError` saying what is wrong.
    A blank transcript is Whisper's where `transcribe` (a note says so, or why Whisper could not: the voice is
    then cross-lingual); what was done is in the features' notes."""
    limit = service.cfg.limits.max_transcript_chars
    transcript, note = inputs.check_transcript(transcript, limit), ""
    if not transcript and transcribe and service.asr.cfg.enabled:  # off: the cross-lingual fallback, no note
        try:
            got = await service.asr.transcribe(reference)
        except AsrUnavailable as e:
            note = said(e)
        else:
            transcript = inputs.check_transcript(got.text[:limit], limit)
            note = HEARD_NOTHING_NOTE if not transcript else Message(
                "transcribed_note", 'transcribed the reference ({language}): "{text}" (type the transcript to '
                "correct it)", language=got.language, text=transcript)
    try:
        voice = await service.voice_from_audio(reference, transcript)
    except (AudioError, PromptAudioError, OSError) as e:
        raise InputError(said_without(e, reference), "reference", code="invalid_audio") from e
    return replace(voice, notes=(note, *voice.notes)) if note else voice


async def prepare(service, x: SpeechInputs) -> Prepared:
    """Check `x`, resolve its voice and build the request. Raises `InputError` (with `param`/`code`,
    counted in the service's metrics by code), or `NotReadyError` before the model is ready."""
    service.require_ready()
    try:
        return await _prepare(service, x)
    except InputError as e:
        service.metrics.input_refused(e.code)
        raise


async def _prepare(service, x: SpeechInputs) -> Prepared:
    lim = service.cfg.limits
    text = "" if x.text_streams else inputs.check_text(x.text, lim.max_text_chars, param="text")
    # an instruction given (even one that cleans to nothing, which check_instruct then refuses) means instruct
    given = str(x.instruct_text or "").strip()
    mode = inputs.check_mode(x.mode if x.mode else ("instruct" if given else "zero_shot"))
    instruct_text = inputs.check_instruct(given, mode, lim.max_instruct_chars)
    stream = bool(x.stream) if x.stream is not None else (x.speed is None or x.speed == 1.0)
    speed = inputs.check_speed(x.speed, stream)
    seed = inputs.check_seed(x.seed)
    fixed_tokens = inputs.check_fixed_tokens(x.fixed_tokens, lim.max_fixed_tokens)
    t0 = time.perf_counter()
    script = dialogue.parse_script(text) if x.dialogue else None
    names = dialogue.speakers(script, lim.max_dialogue_speakers) if script else []
    # a script whose first line names a speaker has no text of the request's own voice: it is not needed
    voice, own = (None, "") if script and script[0].speaker else (await _own_voice(service, x, mode), x.voice or "")
    turns: tuple[Turn, ...] = ()
    if script is not None:
        voices = {"": voice} | {n: await load_voice(service, n, x.owner, param="text") for n in names}
        turns = tuple(Turn(t.text, voices[t.speaker], t.speaker) for t in script)
        voice, own = turns[0].voice, ", ".join(([own or "reference"] if voice is not None else []) + names)
    reference_s = time.perf_counter() - t0
    used = list({id(t.voice): t.voice for t in turns}.values()) or [voice]  # each voice once
    notes = [n for v in used for n in v.notes]
    if mode == "zero_shot" and not all(v.prompt_text.strip() for v in used):
        mode = "cross_lingual"
        notes.append(NO_TRANSCRIPT_NOTE)
    req = SynthesisRequest(text=text, voice=voice, mode=mode, instruct_text=instruct_text, seed=seed, speed=speed,
                           stream=stream, fixed_tokens=fixed_tokens, turns=turns)
    return Prepared(request=req, notes=tuple(notes), voice_name=own, reference_s=reference_s, owner=x.owner.id)


async def _own_voice(service, x: SpeechInputs, mode: str) -> VoiceFeatures:
    """The request's own voice: the saved voice `x.voice`, else the reference clip's features."""
    if x.voice:
        return await load_voice(service, x.voice, x.owner)
    if x.reference:
        reference = x.reference() if callable(x.reference) else x.reference
        # the other modes never read the transcript: nothing to transcribe
        return await reference_voice(service, reference, x.transcript, transcribe=mode == "zero_shot")
    inputs.check_transcript(x.transcript, service.cfg.limits.max_transcript_chars)  # too long says so without a clip
    if x.dialogue:
        raise InputError(Message("lead_needs_voice", "Text before the first speaker tag needs a voice: pick a saved "
                                 "voice or a reference clip for it, or start the script with a tag ({syntax}).",
                                 syntax=dialogue.SYNTAX), "text", code="invalid_dialogue")
    raise InputError(NO_REFERENCE, "reference", code="missing_reference")
