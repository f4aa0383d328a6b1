"""Streaming a synthesis over HTTP: admission, first chunk, then the body as it is produced.

`speech_response(service, req, fmt)` takes a slot of the process's one admission (app/engine/admission.py), starts the
request and waits for its first audio chunk *before* answering, so every failure that happens
before audio (not ready, busy, nothing speakable, prompt too long) is a proper status code with an
OpenAI-shaped body. Then the response streams: `pcm` = raw 16-bit little-endian mono at 24 kHz;
`wav` = a 44-byte header with the "unknown length" sizes (0xFFFFFFFF, as streaming encoders write
it) followed by the same PCM. Headers carry the server-side timing of this request:
X-Request-Id, X-Seed, X-Queue-Ms (waiting for a slot) and X-TTFA-Ms (request start -> first audio).
A client that disconnects cancels the body; its `finally` (and the response's, should the body
never start) closes the synthesis (vLLM abort) and frees the slot. Faults before the first chunk are
503s with Retry-After: `engine_dead` (the engine restarts), `gpu_out_of_memory` (with advice); after
it, the body stops without its last chunk, so the client sees a broken stream, not a short success.
"""

from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from app.audio import OUTPUT_SAMPLE_RATE_HZ, to_int16_pcm
from app.engine.admission import BusyError
from app.engine.pipeline import EmptyTextError
from app.engine.prepare import Prepared
from app.engine.requests import AudioChunk, SynthesisRequest
from app.engine.service import EngineDeadError, GpuOutOfMemoryError, NotReadyError, StudioService
from app.server.errors import ApiError

MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}
RETRY_AFTER_S = 2  # Retry-After for 503 busy / not ready / out of memory
ENGINE_RETRY_AFTER_S = 30  # Retry-After while a dead engine restarts (15-60 s)


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


def wav_stream_header(sample_rate: int = OUTPUT_SAMPLE_RATE_HZ) -> bytes:
    """RIFF/WAVE header for 16-bit mono PCM of unknown length (data and RIFF sizes 0xFFFFFFFF)."""
    byte_rate = sample_rate * 2
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE" + b"fmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, byte_rate, 2, 16)
            + b"data" + struct.pack("<I", 0xFFFFFFFF))


def pcm_bytes(chunk: AudioChunk) -> bytes:
    return to_int16_pcm(chunk.samples).astype("<i2", copy=False).tobytes()


def map_error(e: BaseException) -> ApiError:
    """ApiError for the exceptions a synthesis raises before its first chunk."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, BusyError):
        return ApiError(503, str(e), code="server_busy", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, EngineDeadError):
        return ApiError(503, str(e), code="engine_dead", headers={"Retry-After": str(ENGINE_RETRY_AFTER_S)})
    if isinstance(e, GpuOutOfMemoryError):
        return ApiError(503, str(e), code="gpu_out_of_memory", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, NotReadyError):
        return ApiError(503, str(e), code="not_ready", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, EmptyTextError):
        return ApiError(400, str(e), param="input", code="empty_text")
    if isinstance(e, ValueError):  # e.g. the prompt plus output does not fit the engine's max_model_len
        return ApiError(400, f"synthesis refused: {e}", code="invalid_request")
    raise e


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
                          prepared: Prepared | None = None) -> StreamingResponse:
    """The streamed response for `req` in format `fmt` ("wav" | "pcm"); `ApiError` before any audio.

    `prepared`: `prepare()`'s result that made `req`; its voice name, notes and reference time go into
    the request's metrics record (what the page's stats line and details show).
    """
    if fmt not in MEDIA_TYPES:
        raise ApiError(400, f"response_format {fmt!r} is not supported: use one of {', '.join(MEDIA_TYPES)}",
                       param="response_format", code="unsupported_format")
    t_arrival = time.perf_counter()
    stack = contextlib.AsyncExitStack()
    try:
        queue_s = await stack.enter_async_context(service.admission.admit())
        t_start = time.perf_counter()
        chunks = service.stream(req, queue_wait_s=queue_s, prepared=prepared)
        stack.push_async_callback(chunks.aclose)  # closing aborts the LM request
        head = await _first_audio(chunks)
    except BaseException as e:
        await stack.aclose()
        if isinstance(e, Exception):
            raise map_error(e) from e
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

    out_headers = {"X-Request-Id": req.request_id, "X-Seed": str(req.seed), "X-Queue-Ms": f"{queue_s * 1e3:.1f}",
                   "X-TTFA-Ms": f"{ttfa_ms:.1f}", "X-Server-Ms": f"{(time.perf_counter() - t_arrival) * 1e3:.1f}",
                   "X-Sample-Rate": str(OUTPUT_SAMPLE_RATE_HZ), "Cache-Control": "no-store",
                   "X-Accel-Buffering": "no",  # nginx-style proxies: no holding back (tests/test_proxy.py)
                   **(headers or {})}
    return ClosingStreamingResponse(body(), on_close=stack.aclose, media_type=MEDIA_TYPES[fmt], headers=out_headers)
