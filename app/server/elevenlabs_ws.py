"""ElevenLabs' text-to-speech sockets, so its SDK and agent frameworks (pipecat's ElevenLabsTTSService) speak with a
saved voice unchanged but for their base URL and key (docs/api.md).

`/v1/text-to-speech/{voice_id}/stream-input`: one take. In: the first message (`text: " "`, settings), `text`
pieces (`flush: true` speaks what is buffered), `{"text": ""}` to end. Out: `{"audio": <base64>}` per hop, then
`{"isFinal": true}` and a normal close; with `sync_alignment=true` in the query, each sentence's character times too
(`alignment`, `normalizedAlignment`, on a message of their own once it is aligned). `/multi-stream-input`: several
takes (contexts) on one socket, each message naming its `context_id`; `close_context` ends one, `close_socket` all;
out: `contextId` on each message.
Built on the `/v1/audio/speech/stream` door's steps (app/server/ws_speech.py): the same admission, fair share,
limits, refusals (an error message, then a 44xx/1011 close) and cleanup."""

from __future__ import annotations

import asyncio
import base64
import logging
import weakref
from dataclasses import dataclass, field

import numpy as np
from fastapi import APIRouter, WebSocket, WebSocketException

from app import audio_formats
from app.audio import OUTPUT_SAMPLE_RATE_HZ, to_int16_pcm
from app.engine import bistream
from app.server.identity import Identity, caller_of
from app.server.speech import prepare_or_raise
from app.server.ws_speech import BAD, UNAUTHORIZED, check_room, next_json, serve_socket, speak_arriving
from app.service.owners import Caller
from app.service.prepare import Prepared, SpeechInputs
from app.service.service import StudioService
from app.service.take_timings import SentenceTimer, Timing
from app.service.timings import SentenceTimings

PCM_RATES_HZ = (8000, 16000, 22050, 24000, 44100, 48000)  # `pcm_<rate>`: s16le mono, resampled from 24 kHz
DEFAULT_FORMAT = "mp3_44100_128"  # ElevenLabs' default; mp3 is sent at 24 kHz (its frames say so)
KEY_FIELDS = ("xi-api-key", "xi_api_key")  # the key in the first message: the schema's spelling, the guide's
log = logging.getLogger(__name__)

EL_PARAMS = {"voice": "voice_id", "reference": "voice_id", "prompt_text": "voice_id", "text": "text"}


class AudioOut:
    """One take's audio in the requested `output_format`: `pcm_<rate>` (libswresample, stateful across hops) or
    mp3 (24 kHz, the studio's streaming encoder). `encode(float32 [N] at 24 kHz) -> bytes`, `finish() -> bytes`."""

    def __init__(self, output_format: str) -> None:
        codec, _, rest = output_format.partition("_")
        rate = rest.partition("_")[0]
        self.mp3 = codec == "mp3" and rate.isdigit()
        if not self.mp3 and not (codec == "pcm" and rate.isdigit() and int(rate) in PCM_RATES_HZ):
            raise WebSocketException(BAD, f"output_format {output_format[:20]!r} is not supported: use pcm_<rate> "
                                     f"(rate one of {', '.join(map(str, PCM_RATES_HZ))}) or mp3_<rate>_<kbps>")
        if self.mp3 and not audio_formats.available("mp3"):
            raise WebSocketException(BAD, "mp3 needs PyAV on the server; use pcm_<rate>")
        self.rate_hz = OUTPUT_SAMPLE_RATE_HZ if self.mp3 else int(rate)
        self._enc = audio_formats.make_encoder("mp3") if self.mp3 else None
        self._resampler = None
        if not self.mp3 and self.rate_hz != OUTPUT_SAMPLE_RATE_HZ:
            import av  # a runtime dependency (app/audio_formats.py); imported only where a rate asks for it

            self._av, self._resampler = av, av.AudioResampler(format="s16", layout="mono", rate=self.rate_hz)

    def encode(self, samples: np.ndarray) -> bytes:
        pcm = to_int16_pcm(samples)  # int16 [N] at 24 kHz
        if self._enc is not None:
            return self._enc.encode(pcm)
        if self._resampler is None:
            return pcm.tobytes()
        frame = self._av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm[None]), format="s16", layout="mono")
        frame.sample_rate = OUTPUT_SAMPLE_RATE_HZ
        return self._resampled(frame)

    def finish(self) -> bytes:
        if self._enc is not None:
            return self._enc.finish()
        return self._resampled(None) if self._resampler is not None else b""

    def _resampled(self, frame) -> bytes:
        return b"".join(f.to_ndarray().tobytes() for f in self._resampler.resample(frame))


@dataclass
class Context:
    """One take on the socket: its text as it arrives (`feed`: sentences -> ids), the ids waiting for the LM
    (`queue`, None at the end) and the task that speaks it."""

    id: str | None  # the multi-stream context id; None on the single-take socket
    feed: bistream.TextFeed
    align: bool = False  # sync_alignment: send each sentence's character times
    text: str = ""  # the text pieces spoken so far, as sent
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    task: asyncio.Task | None = None
    ended: bool = False

    def put(self, pieces: list[list[int]]) -> None:
        for ids in pieces:
            self.queue.put_nowait(ids)

    def end(self) -> None:
        if not self.ended:
            self.put(self.feed.flush())
            self.queue.put_nowait(None)
            self.ended = True


def elevenlabs_router(service: StudioService, identity: Identity,
                      stops: weakref.WeakValueDictionary[str, asyncio.Event]) -> APIRouter:
    """The ElevenLabs socket paths bound to the process's service (`stops`: the page's Stop, as ws_speech)."""
    door = ElevenLabsDoor(service, identity, stops)
    router = APIRouter(prefix="/v1/text-to-speech")
    router.add_api_websocket_route("/{voice_id}/stream-input", door.stream_input)
    router.add_api_websocket_route("/{voice_id}/multi-stream-input", door.multi_stream_input)
    return router


class ElevenLabsDoor:
    """The two socket paths' steps, on the process's service: a socket's message loop (`session`), its reads
    (`read`), a message's effect on a take (`feed_message`), a take's start (`open_context`) and its audio out
    (`produce`), and the first message's key (`authorize`). Per-socket state lives in `session`'s locals and the
    `Context`s, never on the door (one door serves every socket)."""

    def __init__(self, service: StudioService, identity: Identity,
                 stops: weakref.WeakValueDictionary[str, asyncio.Event]) -> None:
        self.service, self.identity, self.stops = service, identity, stops
        self.srv, self.lim = service.cfg.server, service.cfg.limits
        self.said_unaligned = False  # the process's log has said why no alignment is sent (said once)

    async def stream_input(self, ws: WebSocket, voice_id: str) -> None:
        key_header_as_bearer(ws.scope, self.identity)
        await serve_socket(ws, self.identity, lambda tasks: self.session(ws, voice_id, tasks, multi=False),
                           key_checked_here=False)

    async def multi_stream_input(self, ws: WebSocket, voice_id: str) -> None:
        key_header_as_bearer(ws.scope, self.identity)
        await serve_socket(ws, self.identity, lambda tasks: self.session(ws, voice_id, tasks, multi=True),
                           key_checked_here=False)

    async def session(self, ws: WebSocket, voice_id: str, tasks: list[asyncio.Task], *, multi: bool) -> None:
        out_format = ws.query_params.get("output_format", DEFAULT_FORMAT)
        AudioOut(out_format)  # refused before any work when unsupported
        failed = asyncio.get_running_loop().create_future()  # a take's exception, raised by the next read
        msg = await next_json(ws, self.srv.ws_idle_timeout_s)
        self.authorize(ws, msg)
        contexts: dict[str | None, Context] = {}
        while True:
            cid = _context_id(msg) if multi else None
            text = msg.get("text")
            if text is not None and not isinstance(text, str):
                raise WebSocketException(BAD, "\"text\" must be a string")
            if multi and msg.get("close_socket"):
                break
            ctx = contexts.get(cid)
            keepalive = text == "" and (ctx is None or multi)  # multi: {"text": ""} keeps a context alive
            if ctx is None and not keepalive and not msg.get("close_context"):
                ctx = contexts[cid] = await self.open_context(ws, voice_id, cid, out_format, tasks, failed)
            if ctx is not None and not ctx.ended:
                self.feed_message(ctx, msg, text, multi)
            if not multi and ctx is not None and ctx.ended:
                break
            msg = await self.read(ws, failed)
        for ctx in contexts.values():
            ctx.end()
        await asyncio.gather(*(c.task for c in contexts.values() if c.task is not None))

    async def read(self, ws: WebSocket, failed: asyncio.Future) -> dict:
        """The next message, unless a take failed first (its exception is raised: the socket is refused)."""
        reading = asyncio.ensure_future(next_json(ws, self.srv.ws_idle_timeout_s))
        try:
            await asyncio.wait({reading, failed}, return_when=asyncio.FIRST_COMPLETED)
            if failed.done():
                failed.result()
            return reading.result()
        finally:
            reading.cancel()

    def feed_message(self, ctx: Context, msg: dict, text: str | None, multi: bool) -> None:
        """A text piece, a flush, or the end (single: empty text; multi: close_context) for `ctx`."""
        if text and text.strip():
            check_room(ctx.feed, text, self.lim.max_text_chars)
            ctx.text += text
            ctx.put(ctx.feed.add(text))
        if msg.get("flush") is True:
            ctx.put(ctx.feed.flush())
        if msg.get("close_context") is True or (not multi and text == ""):
            ctx.end()

    async def open_context(self, ws: WebSocket, voice_id: str, cid: str | None, out_format: str,
                           tasks: list[asyncio.Task], failed: asyncio.Future) -> Context:
        """A take for `cid`, validated and admitted like the native door's, its `produce` task started."""
        caller = caller_of(ws.scope)
        seed = ws.query_params.get("seed")
        prepared = await prepare_or_raise(self.service, SpeechInputs(
            text_streams=True, voice=voice_id, seed=int(seed) if seed and seed.lstrip("-").isdigit() else seed,
            stream=True, owner=caller.owner), EL_PARAMS)
        ctx = Context(cid, bistream.TextFeed(self.service.synth.model.frontend),  # ready: `prepare` said so
                      align=ws.query_params.get("sync_alignment", "").lower() == "true")
        stop = self.stops[prepared.request.request_id] = asyncio.Event()  # the page's Stop reaches this take too
        ctx.task = asyncio.create_task(self.produce(ws, ctx, prepared, caller, stop, out_format, failed))
        tasks.append(ctx.task)
        return ctx

    async def produce(self, ws: WebSocket, ctx: Context, prepared: Prepared, caller: Caller, stop: asyncio.Event,
                      out_format: str, failed: asyncio.Future) -> None:
        """`ctx`'s take as base64 audio messages, then isFinal; its failure also goes to `failed` (the socket's)."""
        audio = AudioOut(out_format)
        tail = {} if ctx.id is None else {"contextId": ctx.id}
        # the socket's take is one segment (its text arrives as it is spoken): one alignment, after its last chunk
        timer = SentenceTimer(self.service.aligner, lambda: [ctx.text.strip()]) if ctx.align else None
        try:
            async for chunk in speak_arriving(self.service, prepared, caller, ctx.queue, stop):
                if timer is not None:
                    timer.push(chunk)
                data = await asyncio.to_thread(audio.encode, chunk.samples) if chunk.samples.size else b""
                if chunk.is_final:
                    data += await asyncio.to_thread(audio.finish)
                if data:
                    await ws.send_json({"audio": base64.b64encode(data).decode(), "isFinal": False, **tail})
                for t in timer.ready() if timer is not None else ():
                    await self.send_alignment(ws, ctx, t, tail)
            if timer is not None:
                async for t in timer.rest():
                    await self.send_alignment(ws, ctx, t, tail)
            await ws.send_json({"isFinal": True, **tail})
        except Exception as e:
            if not failed.done():
                failed.set_exception(e)
            raise
        finally:
            if timer is not None:
                await timer.aclose()

    async def send_alignment(self, ws: WebSocket, ctx: Context, t: Timing, tail: dict) -> None:
        """A sentence's times as ElevenLabs' `alignment` on a message with no audio (its audio went before it); an
        unavailable aligner sends nothing and is logged once."""
        if isinstance(t, str):
            if not self.said_unaligned:
                self.said_unaligned = True
                log.warning("sync_alignment: no alignment is sent: %s", t)
            return
        chars = el_alignment(t, ctx.text)
        await ws.send_json({"audio": "", "isFinal": False, "alignment": chars, "normalizedAlignment": chars, **tail})

    def authorize(self, ws: WebSocket, first: dict) -> None:
        """The key of the first message (where the header had none) as the caller's; refused (4401) when keys are
        set and no valid one came."""
        key = next((first[k] for k in KEY_FIELDS if isinstance(first.get(k), str) and first[k]), None)
        as_bearer(ws.scope, key.encode() if key is not None else None, self.identity)
        if self.identity.any_key and self.identity.bearer(ws.scope) is None:
            raise WebSocketException(UNAUTHORIZED, "missing or wrong API key: send it as the xi-api-key header "
                                     "(or the first message's xi-api-key)")


def el_alignment(t: SentenceTimings, sent: str) -> dict[str, list]:
    """`t`'s characters as ElevenLabs' alignment: ms from the sentence's first sample (ElevenLabs' times restart in
    every message: pipecat advances its clock by each alignment's end, so a client's clock adds up to the take's),
    the whitespace around the text as `sent` kept (0 ms long at its ends) and one trailing space where it has none
    (a client that ends a word at a space, as pipecat does, then hears the last word)."""
    lead = sent[:len(sent) - len(sent.lstrip())]
    trail = sent[len(sent.rstrip()):] or " "
    span_ms = t.end_ms - t.start_ms
    return {"chars": [*lead, *t.chars.chars, *trail],
            "charStartTimesMs": [0] * len(lead) + [s - t.start_ms for s in t.chars.start_ms] + [span_ms] * len(trail),
            "charDurationsMs": [0] * len(lead) + list(t.chars.duration_ms) + [0] * len(trail)}


def key_header_as_bearer(scope: dict, identity: Identity) -> None:
    """`xi-api-key: <key>` (ElevenLabs' header) read as `Authorization: Bearer <key>` (`as_bearer`)."""
    as_bearer(scope, next((v for k, v in scope.get("headers", []) if k == b"xi-api-key" and v), None), identity)


def as_bearer(scope: dict, key: bytes | None, identity: Identity) -> None:
    """An ElevenLabs key read as `Authorization: Bearer <key>`, the studio's keys and owners, unless the socket
    also sends an Authorization header; the caller AccessLimits found is then found again."""
    headers = scope.get("headers", [])
    if key is not None and not any(k == b"authorization" for k, _ in headers):
        scope["headers"] = [*headers, (b"authorization", b"Bearer " + key)]
        identity.identify(scope, None)


def _context_id(msg: dict) -> str:
    cid = msg.get("context_id", msg.get("contextId", ""))
    if not isinstance(cid, str) or len(cid) > 128:
        raise WebSocketException(BAD, "context_id must be a string of at most 128 characters")
    return cid
