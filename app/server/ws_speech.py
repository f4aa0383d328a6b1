"""`/v1/audio/speech/stream`: text that streams in over a WebSocket, speech that streams out (docs/api.md).
In: JSON `start` (the /v1/audio/speech body less `input`, plus `timestamps`), `text` deltas, `flush`, `close`. Out:
binary audio, JSON `started`/`segment`/`timestamps` (opt-in)/`done`/`error`, then a close (1000, or a 44xx/1011
code with the reason)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, WebSocket, WebSocketDisconnect, WebSocketException

from app import audio_formats
from app.audio import OUTPUT_SAMPLE_RATE_HZ
from app.engine import bistream
from app.engine.requests import AudioChunk
from app.server.errors import ApiError
from app.server.identity import Identity, caller_of
from app.server.limits import KEY_REFUSED, socket_refusal
from app.server.openai_api import V1_PARAMS
from app.server.speech import map_error, pcm_bytes, prepare_or_raise
from app.server.studio_stream import reference_path
from app.server.studio_timings import PageTimings
from app.server.ws_timings import alignment_messages, take_texts
from app.service.owners import Caller, Owner
from app.service.prepare import Prepared, SpeechInputs
from app.service.refusals import refusal
from app.service.service import StudioService

log = logging.getLogger(__name__)
START_FIELDS = {"type", "voice", "response_format", "speed", "seed", "instructions", "timestamps"}
PAGE_FIELDS = {"prompt_audio", "prompt_text", "mode"}  # the page's switch: its uploaded reference, as /studio/speech
# close codes (44xx: HTTP's status + 4000, as AccessLimits' refusals: 4401, 4403, 4429)
BAD, UNAUTHORIZED, FORBIDDEN, BUSY = 4400, 4401, 4403, 4429
IDLE, FAILED = 4408, 1011


def ws_router(service: StudioService, identity: Identity, stops: weakref.WeakValueDictionary[str, asyncio.Event],
              timings: PageTimings) -> APIRouter:
    """The socket door bound to the process's service (`stops`: the page's Stop, by request id; `timings`: the
    page's takes' words, for its words panel)."""
    router = APIRouter(prefix="/v1")

    @router.websocket("/audio/speech/stream")
    async def speech_stream(ws: WebSocket) -> None:
        await serve_socket(ws, identity, SpeechSession(service, ws, stops, timings).run)

    return router


class SpeechSession:
    """One socket's take: its start message prepared (`run`), the text as it arrives (`reader`: sentences ->
    ids on `queue`), the speech as it is made (`produce`). `serve_socket` ends its tasks, whatever happened."""

    def __init__(self, service: StudioService, ws: WebSocket,
                 stops: weakref.WeakValueDictionary[str, asyncio.Event], timings: PageTimings) -> None:
        self.service, self.ws, self.stops, self.timings = service, ws, stops, timings
        self.queue: asyncio.Queue[list[int] | None] = asyncio.Queue()  # a sentence's text ids per item; None: the end
        self.segments: list[int] = []  # n_tokens of each text segment read so far

    async def message(self) -> dict:
        """The next JSON message; a refusal on silence past the idle timeout or anything but a JSON object."""
        msg = await next_json(self.ws, self.service.cfg.server.ws_idle_timeout_s)
        if not isinstance(msg.get("type"), str):
            raise WebSocketException(BAD, "a message must be a JSON object with a \"type\"")
        return msg

    async def run(self, tasks: list[asyncio.Task]) -> None:
        """The start, prepared as every door's request (readiness included); then `reader` and `produce` until
        both end (the reader at close, then the rest of the speech), unless one raises first."""
        caller = caller_of(self.ws.scope)
        start = await self.message()
        fmt, inputs = start_inputs(start, caller.owner)
        prepared = await prepare_or_raise(self.service, inputs, V1_PARAMS)
        req = prepared.request
        feed = bistream.TextFeed(self.service.synth.model.frontend)
        stop = self.stops[req.request_id] = asyncio.Event()  # the page's Stop (POST /studio/requests/{id}/stop)
        await self.ws.send_json({"type": "started", "request_id": req.request_id, "seed": req.seed,
                                 "sample_rate": OUTPUT_SAMPLE_RATE_HZ, "media_type": audio_formats.MEDIA_TYPES[fmt]})
        tasks += [asyncio.create_task(self.reader(feed)),
                  asyncio.create_task(self.produce(prepared, caller, fmt, stop, feed, start))]
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            t.result()  # raises a task's exception

    async def reader(self, feed: bistream.TextFeed) -> None:
        """`text`, `flush` and `close` messages: each sentence's ids on the queue (and a `segment` message)."""
        while True:
            msg = await self.message()
            kind = msg["type"]
            if kind == "text":
                if not isinstance(msg.get("text"), str):
                    raise WebSocketException(BAD, "a text message needs a string \"text\"")
                check_room(feed, msg["text"], self.service.cfg.limits.max_text_chars)
                ids = feed.add(msg["text"])
            elif kind in ("flush", "close"):
                ids = feed.flush()
            else:
                raise WebSocketException(BAD, f"unexpected message type {kind[:20]!r} (send text, flush or close)")
            for piece in ids:
                await self.ws.send_json({"type": "segment", "index": len(self.segments), "n_tokens": len(piece)})
                self.segments.append(len(piece))
                self.queue.put_nowait(piece)
            if kind == "close":
                self.queue.put_nowait(None)
                return

    async def produce(self, prepared: Prepared, caller: Caller, fmt: str, stop: asyncio.Event,
                      feed: bistream.TextFeed, start: dict) -> None:
        """The take's audio as binary messages (a WAV header first for wav), with `timestamps` its sentences'
        timings once the take is made (app/server/ws_timings.py), then `done` with its stats. A page's take (its
        start has the page's fields) also keeps its words for the page's words panel (studio_timings.py)."""
        if fmt == "wav":
            await self.ws.send_bytes(audio_formats.wav_header(None))
        final, rid, asked = None, prepared.request.request_id, start.get("timestamps", False)
        page = self.timings.begin(rid, caller.owner, lambda: take_texts(feed)) if PAGE_FIELDS & start.keys() else None
        try:
            async with alignment_messages(self.ws, self.service.aligner, feed, on=asked) as tap:
                async for chunk in speak_arriving(self.service, prepared, caller, self.queue, stop):
                    if chunk.samples.size:
                        await self.ws.send_bytes(pcm_bytes(chunk))
                    tap(chunk)
                    if page is not None:
                        page.push(chunk)
                    final = chunk if chunk.is_final else final
        finally:
            if page is not None:
                page.end()
        if final is not None:  # none: the page's Stop ended the take
            stats = dataclasses.asdict(final.stats) if final.stats else {}
            stats["n_segments"] = len(self.segments)  # the segments said (the engine's take is one)
            await self.ws.send_json({"type": "done", "request_id": rid, "stats": stats})


def start_inputs(start: dict, owner: Owner) -> tuple[str, SpeechInputs]:
    """(response format, the take's inputs) of a `start` message, refused (4400) where it is not one."""
    if start["type"] != "start":
        raise WebSocketException(BAD, f"the first message must be start, not {start['type'][:20]!r}")
    if extra := sorted(set(start) - START_FIELDS - PAGE_FIELDS):
        raise WebSocketException(BAD, f"start has unknown fields {', '.join(extra)[:60]}")
    fmt = start.get("response_format", "pcm")
    if fmt not in ("pcm", "wav"):
        raise WebSocketException(BAD, "response_format must be pcm or wav")
    if not isinstance(start.get("timestamps", False), bool):
        raise WebSocketException(BAD, "timestamps must be true or false")
    raw = start.get("prompt_audio")
    reference = (lambda: reference_path(raw)) if isinstance(raw, str) and raw else None
    return fmt, SpeechInputs(
        text_streams=True, voice=start.get("voice"), instruct_text=start.get("instructions") or "", reference=reference,
        transcript=start.get("prompt_text"), mode=start.get("mode"), seed=start.get("seed"),
        speed=start.get("speed", 1.0), stream=True, owner=owner)


# --- the socket doors' shared steps (this door and app/server/elevenlabs_ws.py) ---------------------------------


def check_room(feed: bistream.TextFeed, text: str, max_chars: int) -> None:
    """Refused (4400) when `text` would take the take's text past `max_chars` ([limits] max_text_chars)."""
    if feed.n_chars + len(text) > max_chars:
        raise WebSocketException(BAD, f"the text is over {max_chars} characters ([limits] max_text_chars)")


async def next_json(ws: WebSocket, idle_s: float) -> dict:
    """The next JSON object; a refusal (WebSocketException) on silence past `idle_s` seconds ([server]
    ws_idle_timeout_s), a binary frame, or anything but a JSON object."""
    try:
        msg = await asyncio.wait_for(ws.receive_json(), idle_s)
    except TimeoutError:
        raise WebSocketException(IDLE, f"no message for {idle_s:g} s ([server] ws_idle_timeout_s)") from None
    except KeyError:  # a binary frame: Starlette's receive_json finds no "text"
        raise WebSocketException(BAD, "send JSON text frames, not binary") from None
    except ValueError:
        raise WebSocketException(BAD, "a message is not JSON: send JSON objects") from None
    if not isinstance(msg, dict):
        raise WebSocketException(BAD, "a message must be a JSON object")
    return msg


async def serve_socket(ws: WebSocket, identity: Identity, session: Callable[[list[asyncio.Task]], Awaitable[None]],
                       *, key_checked_here: bool = True) -> None:
    """A socket door's life: accept (the Caller, origin, rate limit and login: AccessLimits, as for every door;
    with `key_checked_here`, no valid `Authorization: Bearer` key where keys are set is refused here, else
    `session` checks the key it reads); `session(tasks)`; a normal close. A refusal is sent as an error message,
    then the close (44xx/1011 and the reason); the tasks `session` started end here, whatever happened."""
    await ws.accept()
    tasks: list[asyncio.Task] = []
    try:
        if key_checked_here and identity.any_key and identity.bearer(ws.scope) is None:
            raise WebSocketException(UNAUTHORIZED, KEY_REFUSED)
        await session(tasks)
        await ws.close(1000)
    except WebSocketException as e:  # a refusal: sent first as an error message, then the close
        await _close(ws, e.code, e.reason)
    except WebSocketDisconnect:
        pass
    except Exception as e:  # a refusal of prepare, the share or admission, or a failure: said, then closed
        code, reason = close_for(e)
        if code == FAILED:
            log.exception("speech stream failed")
        else:  # a refusal: one line, no traceback (a flood must not fill the log)
            log.info("refused a WebSocket take (%d): %s", code, getattr(e, "code", None) or type(e).__name__)
        await _close(ws, code, reason)
    finally:  # readers and syntheses (their LM requests aborted) end here, whatever happened
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t


def close_for(e: Exception) -> tuple[int, str]:
    """(close code, reason) for what ended a session: a refusal (an ApiError, or one the seam reads in an engine
    exception: the share, admission, a dead engine) by its status, else FAILED, whose reason names nothing
    of the server (the traceback goes to the log)."""
    if not isinstance(e, ApiError) and refusal(e) is not None:
        e = map_error(e)
    if not isinstance(e, ApiError):
        return FAILED, "the synthesis failed on the server; try again"
    return (BUSY if e.status in (429, 503) else FORBIDDEN if e.status == 403 else BAD), str(e.message)


async def speak_arriving(service: StudioService, prepared: Prepared, caller: Caller,
                         queue: asyncio.Queue[list[int] | None], stop: asyncio.Event | None
                         ) -> AsyncIterator[AudioChunk]:
    """The chunks of `prepared`'s take whose text ids arrive on `queue` (a sentence's ids per item, None at the
    end): the bi-streaming decode inside the speech route's fair share, admission and request record."""
    async def arriving() -> AsyncIterator[list[int]]:
        while (ids := await queue.get()) is not None:
            yield ids

    tokens = bistream.take_tokens(service.synth, prepared.request, arriving(),  # ready: `prepare` said so
                                  service.cfg.limits.max_text_chars)
    async with service.speak(prepared.request, prepared=prepared, caller=caller, tokens=tokens,
                             stop=stop) as (_, chunks):
        async for chunk in chunks:
            yield chunk


async def _close(ws: WebSocket, code: int, reason: str) -> None:
    with contextlib.suppress(Exception):  # the client may be gone already
        for message in socket_refusal(code, reason):
            await ws.send(message)
