"""Streaming a synthesis over HTTP, for every door: prepare, admission, first chunk, then the body.

`speech_response(service, req, fmt)` takes a slot of the process's one admission and waits for the
first audio chunk *before* answering, so a failure before audio (not ready, busy, engine dead, out of
memory, nothing speakable) is a status code with an OpenAI-shaped body (`map_error`); after it, the
body stops without its last chunk (a broken stream, not a short success). `pcm` = raw s16le mono
24 kHz; `wav` = a header with the "unknown length" sizes (0xFFFFFFFF), then the same PCM. Headers
carry X-Request-Id, X-Seed, X-Mode, X-Queue-Ms and X-TTFA-Ms. A disconnect closes the synthesis (vLLM abort)
and frees the slot, also when the body never started.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from app.audio import OUTPUT_SAMPLE_RATE_HZ, to_int16_pcm
from app.engine.inputs import InputError
from app.engine.prepare import Prepared, SpeechInputs, prepare
from app.engine.refusals import refusal
from app.engine.requests import AudioChunk, SynthesisRequest
from app.engine.service import NotReadyError, StudioService
from app.server.errors import ApiError

MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always runs `on_close`, also when the body never starts (client gone)."""

    def __init__(self, content, *, on_close, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


def wav_stream_header() -> bytes:
    """RIFF/WAVE header for 16-bit mono 24 kHz PCM of unknown length (data and RIFF sizes 0xFFFFFFFF)."""
    rate = OUTPUT_SAMPLE_RATE_HZ
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE" + b"fmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
            + b"data" + struct.pack("<I", 0xFFFFFFFF))


def pcm_bytes(chunk: AudioChunk) -> bytes:
    return to_int16_pcm(chunk.samples).tobytes()  # already little-endian int16


def map_error(e: BaseException, params: dict[str, str] | None = None) -> ApiError:
    """ApiError for what `prepare` or a synthesis raises before its first chunk (app/engine/refusals.py);
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
    except (NotReadyError, InputError) as e:
        raise map_error(e, params) from e


async def _first_audio(chunks: AsyncIterator[AudioChunk]) -> list[AudioChunk]:
    """Chunks up to and including the first one with samples (or the final one)."""
    got = []
    async for chunk in chunks:
        got.append(chunk)
        if chunk.samples.size or chunk.is_final:
            break
    return got


async def speech_response(service: StudioService, req: SynthesisRequest, fmt: str,
                          headers: dict[str, str] | None = None, *,
                          prepared: Prepared | None = None, client: str = "",
                          stop: asyncio.Event | None = None, params: dict[str, str] | None = None
                          ) -> StreamingResponse:
    """The streamed response for `req` in format `fmt` ("wav" | "pcm", checked by the door); `ApiError`
    before any audio. `prepared` (what made `req`) goes into the request's metrics record; `client`
    (app/server/identity.py) holds one of its fair-share places until the body ends."""
    assert fmt in MEDIA_TYPES, fmt
    t_arrival = time.perf_counter()
    stack = contextlib.AsyncExitStack()
    try:
        queue_s, chunks = await stack.enter_async_context(service.speak(req, prepared=prepared, client=client,
                                                                        stop=stop))
        t_start = time.perf_counter()
        head = await _first_audio(chunks)
    except BaseException as e:
        await stack.aclose()
        if isinstance(e, Exception):
            raise map_error(e, params) from e
        raise
    ttfa_ms = (time.perf_counter() - t_start) * 1e3

    async def body() -> AsyncIterator[bytes]:
        try:
            if fmt == "wav":
                yield wav_stream_header()
            for chunk in head:
                if chunk.samples.size:
                    yield pcm_bytes(chunk)
            if head and head[-1].is_final:
                return
            async for chunk in chunks:
                if chunk.samples.size:
                    yield pcm_bytes(chunk)
        finally:
            await stack.aclose()

    out_headers = {"X-Request-Id": req.request_id, "X-Seed": str(req.seed), "X-Mode": req.mode,
                   "X-Queue-Ms": f"{queue_s * 1e3:.1f}", "X-TTFA-Ms": f"{ttfa_ms:.1f}",
                   "X-Server-Ms": f"{(time.perf_counter() - t_arrival) * 1e3:.1f}",
                   "X-Sample-Rate": str(OUTPUT_SAMPLE_RATE_HZ), "Cache-Control": "no-store",
                   "X-Accel-Buffering": "no",  # nginx-style proxies: no holding back (tests/test_proxy.py)
                   **(headers or {})}
    return ClosingStreamingResponse(body(), on_close=stack.aclose, media_type=MEDIA_TYPES[fmt], headers=out_headers)
