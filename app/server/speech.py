"""Streaming a synthesis over HTTP, for every door: prepare, admission, first chunk, then the body (docs/design.md)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np
from fastapi.responses import Response, StreamingResponse

from app import audio_formats
from app.audio import OUTPUT_SAMPLE_RATE_HZ, to_int16_pcm
from app.engine.requests import AudioChunk, SynthesisRequest
from app.server.errors import ApiError
from app.service.owners import NOBODY, Caller
from app.service.prepare import Prepared, SpeechInputs, prepare
from app.service.refusals import refusal
from app.service.service import StudioService


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always runs `on_close`, also when the body never starts (client gone)."""

    def __init__(self, content, *, on_close, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close  # also read by a door that re-wraps the body (sse_speech.py)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


def pcm_bytes(chunk: AudioChunk) -> bytes:
    return to_int16_pcm(chunk.samples).tobytes()  # already little-endian int16


def map_error(e: BaseException, params: dict[str, str] | None = None) -> ApiError:
    """ApiError for what `prepare` or a synthesis raises before its first chunk (app/service/refusals.py);
    `params` maps prepare's field names to the door's. Not a refusal: `e` is raised again."""
    r = refusal(e)
    if r is None:
        raise e
    headers = None if r.retry_after_s is None else {"Retry-After": f"{r.retry_after_s:g}"}
    param = None if r.param is None else (params or {}).get(r.param, r.param)
    return ApiError(r.status, r.message, param=param, code=r.code, headers=headers)


async def prepare_or_raise(service: StudioService, x: SpeechInputs, params: dict[str, str]) -> Prepared:
    """`prepare(service, x)`, its refusals as `ApiError` (`params`: see `map_error`)."""
    try:
        return await prepare(service, x)
    except Exception as e:  # a refusal (app/service/refusals.py); anything else is raised again as it is
        raise map_error(e, params) from e


Tap = Callable[[AudioChunk], None]  # sees each chunk of the take as it is taken for the body (never waits)


def no_tap(chunk: AudioChunk) -> None:
    pass


async def _first_audio(chunks: AsyncIterator[AudioChunk], whole: bool, tap: Tap) -> list[AudioChunk]:
    """Chunks up to and including the first one with samples (or the final one); `whole`: all of them."""
    got = []
    async for chunk in chunks:
        tap(chunk)
        got.append(chunk)
        if (chunk.samples.size and not whole) or chunk.is_final:
            break
    return got


CLIENT_GONE_STATUS = 499  # nginx's "client closed request": nobody reads it, the access log says what happened


async def _unless_gone(work: Awaitable[list[AudioChunk]], gone: Callable[[], Awaitable[None]] | None
                       ) -> list[AudioChunk] | None:
    """`work`'s result, or None (`work` cancelled: its synthesis aborted) when `gone()` returns first."""
    if gone is None:
        return await work
    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    finally:
        watcher.cancel()
        task.cancel()


async def speech_response(service: StudioService, req: SynthesisRequest, fmt: str,
                          headers: dict[str, str] | None = None, *,
                          prepared: Prepared | None = None, caller: Caller = NOBODY,
                          stop: asyncio.Event | None = None, params: dict[str, str] | None = None,
                          gone: Callable[[], Awaitable[None]] | None = None, tap: Tap = no_tap) -> Response:
    """The response for `req` in format `fmt` (one of audio_formats.FORMATS, available: checked by the door),
    streamed, or whole when `req` is not streamed (speed != 1) or `fmt` is only readable everywhere with its
    exact length in its header (audio_formats.WHOLE_ONLY); `ApiError` before any audio (a whole one: before any
    byte). `prepared` (what made `req`) goes into the request's metrics record; `caller`'s client
    (app/server/identity.py) holds one of its fair-share places until the body ends. `gone()` returns when the
    client disconnects: a whole response stops being made then (a streamed one stops when its body can no longer
    be sent). `tap` sees every chunk of the take in order (the SSE door's word timings)."""
    assert fmt in audio_formats.FORMATS, fmt
    whole = not req.stream or fmt in audio_formats.WHOLE_ONLY
    t_arrival = time.perf_counter()
    stack = contextlib.AsyncExitStack()
    try:
        queue_s, chunks = await stack.enter_async_context(service.speak(req, prepared=prepared, caller=caller,
                                                                        stop=stop))
        t_start = time.perf_counter()
        first = _first_audio(chunks, whole, tap)
        head = await (_unless_gone(first, gone) if whole else first)
        if whole:
            await stack.aclose()
        if head is None:
            return Response(status_code=CLIENT_GONE_STATUS)
    except BaseException as e:
        await stack.aclose()
        if isinstance(e, Exception):
            raise map_error(e, params) from e
        raise
    ttfa_ms = (time.perf_counter() - t_start) * 1e3
    out_headers = {"X-Request-Id": req.request_id, "X-Seed": str(req.seed), "X-Mode": req.mode,
                   "X-Queue-Ms": f"{queue_s * 1e3:.1f}", "X-TTFA-Ms": f"{ttfa_ms:.1f}",
                   "X-Server-Ms": f"{(time.perf_counter() - t_arrival) * 1e3:.1f}",
                   "X-Sample-Rate": str(OUTPUT_SAMPLE_RATE_HZ), "Cache-Control": "no-store",
                   "X-Accel-Buffering": "no",  # nginx-style proxies: no holding back (tests/test_proxy.py)
                   **(headers or {})}
    media_type = audio_formats.MEDIA_TYPES[fmt]
    if whole:  # int16 [N]: the whole take; the Response sets Content-Length
        pcm = np.concatenate([to_int16_pcm(c.samples) for c in head] or [np.zeros(0, "<i2")])
        data = await asyncio.to_thread(audio_formats.encode_whole, pcm, fmt)
        return Response(data, media_type=media_type, headers=out_headers)

    body = _body(fmt, head, chunks, tap, stack)
    content = body if fmt in ("wav", "pcm") else audio_formats.encode_stream(body, fmt)
    return ClosingStreamingResponse(content, on_close=stack.aclose, media_type=media_type, headers=out_headers)


async def _body(fmt: str, head: list[AudioChunk], chunks: AsyncIterator[AudioChunk], tap: Tap,
                stack: contextlib.AsyncExitStack) -> AsyncIterator[bytes]:
    """A streamed take's PCM (after a WAV header for wav): `head`, then the rest of `chunks`; `stack` (the take's
    share, slot and stream) closes when it ends, however it ends."""
    try:
        if fmt == "wav":
            yield audio_formats.wav_header(None)  # 16-bit mono 24 kHz of unknown length
        for chunk in head:
            if chunk.samples.size:
                yield pcm_bytes(chunk)
        if head and head[-1].is_final:
            return
        async for chunk in chunks:
            tap(chunk)
            if chunk.samples.size:
                yield pcm_bytes(chunk)
    finally:
        await stack.aclose()
