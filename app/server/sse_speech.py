"""`/v1/audio/speech` with `stream_format: "sse"`: the same take as the byte stream, as OpenAI's server-sent events
(docs/api.md). Each piece of the body (`response_format`'s bytes, as the plain stream would send them) becomes one
`speech.audio.delta` event with the piece in base64; then one `speech.audio.done` with `usage`. With `timestamps`
on, each sentence's word and character times come as a `speech.audio.timestamps` event between the deltas (with
the first delta after its alignment is done, or before `done`)."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict

from fastapi.responses import Response, StreamingResponse

from app.server.speech import ClosingStreamingResponse, Tap, no_tap
from app.service.prepare import Prepared
from app.service.service import StudioService
from app.service.take_timings import SentenceTimer, Timing

MEDIA_TYPE = "text/event-stream"
# the byte stream's headers an SSE response keeps (its Content-Type and any Content-Length are the events')
KEPT_HEADERS = ("cache-control", "x-accel-buffering")


def event(payload: dict) -> bytes:
    """One SSE event: a `data:` line of compact JSON and the blank line that ends it."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def usage(service: StudioService, request_id: str, text: str) -> dict[str, int]:
    """OpenAI's `usage` of a finished take: input_tokens = the input's text tokens (the LM's Qwen2 tokenizer on the
    text as sent), output_tokens = the speech tokens the LM made (25 per second of speech; its request record)."""
    n_in = len(service.synth.model.frontend.tokenizer.encode(text))  # ready: `prepare` said so
    rec = service.metrics.record(request_id)
    n_out = rec.stats.n_tokens if rec is not None and rec.stats is not None else 0
    return {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}


def timestamps_event(t: Timing) -> dict:
    """A sentence's `speech.audio.timestamps` event."""
    return {"type": "speech.audio.timestamps", **timings_json(t)}


def timings_json(t: Timing) -> dict:
    """A sentence's timings as the doors send them (this one's events, the text-streaming socket's `timestamps`
    messages: app/server/ws_timings.py), ms from the take's first sample; a `str` (the take has no timings: why) as
    no words and that `note`."""
    if isinstance(t, str):
        return {"words": [], "chars": {"chars": [], "charStartTimesMs": [], "charDurationsMs": []}, "note": t}
    return {"text": t.text, "start_ms": t.start_ms, "end_ms": t.end_ms, "words": [asdict(w) for w in t.words],
            "chars": t.chars.to_json(), **({"note": t.note} if t.note else {})}


async def sse_response(service: StudioService, prepared: Prepared, text: str,
                       speak: Callable[[Tap], Awaitable[Response]], *, timestamps: bool) -> Response:
    """The take `speak(tap)` answers (`speech_response` for `prepared`, of `text`) as events; `timestamps`: its
    sentences aligned as they finish (the service's aligner, off the audio's path) and sent as events too."""
    timer = None
    if timestamps:  # (the service is ready: `prepare` said so)
        timer = SentenceTimer(service.aligner, lambda: [t.text for t in service.synth.segments(prepared.request)])
    try:
        audio = await speak(no_tap if timer is None else timer.push)
    except BaseException:
        if timer is not None:
            await timer.aclose()
        raise
    if audio.status_code != 200 and timer is not None:
        await timer.aclose()
    return as_sse(service, audio, prepared.request.request_id, text, timer)


def as_sse(service: StudioService, audio: Response, request_id: str, text: str,
           timer: SentenceTimer | None = None) -> Response:
    """`audio` (what `speech_response` answered for the take `request_id` of `text`) as server-sent events: a
    streamed body event by event as its pieces come, a whole one (speed != 1, flac) as one delta; `timer` (the
    take's chunks tapped into it) adds its timings and is closed with the response. A response that is no take
    (the client left before the first audio) is returned as it is."""
    if audio.status_code != 200:
        return audio
    headers = {k: v for k, v in audio.headers.items() if k.startswith("x-") or k in KEPT_HEADERS}
    if isinstance(audio, StreamingResponse):
        pieces, on_close = audio.body_iterator, getattr(audio, "on_close", None)
    else:
        pieces, on_close = _one(bytes(audio.body)), None

    async def events() -> AsyncIterator[bytes]:
        async for piece in pieces:  # ends after the take's stack closed: its request record exists then
            if piece:
                yield event({"type": "speech.audio.delta", "audio": base64.b64encode(piece).decode()})
            for t in timer.ready() if timer is not None else ():
                yield event(timestamps_event(t))
        if timer is not None:
            async for t in timer.rest():
                yield event(timestamps_event(t))
        yield event({"type": "speech.audio.done", "usage": usage(service, request_id, text)})

    async def close() -> None:  # also when the body never starts (the client left)
        try:
            if on_close is not None:
                await on_close()
        finally:
            if timer is not None:
                await timer.aclose()

    if on_close is None and timer is None:
        return StreamingResponse(events(), media_type=MEDIA_TYPE, headers=headers)
    return ClosingStreamingResponse(events(), on_close=close, media_type=MEDIA_TYPE, headers=headers)


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data
