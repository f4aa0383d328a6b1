"""The page's word timings: each /studio/speech take's sentences aligned as they finish (`SentenceTimer`, off the
audio's path), kept by request id for a while and sent to the page's player as NDJSON
(GET /studio/requests/{id}/timings; docs/timings.md, "On the page")."""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from app.config import AsrConfig
from app.engine.requests import AudioChunk
from app.message import Message, lang_of, say
from app.model.asr import resolve_device
from app.server.errors import ApiError
from app.server.identity import caller_of
from app.server.speech import ClosingStreamingResponse, Tap
from app.server.sse_speech import timestamps_event
from app.service.owners import Caller, Owner
from app.service.prepare import Prepared
from app.service.service import StudioService
from app.service.subtitles import to_srt, to_vtt
from app.service.take_timings import SentenceTimer, Timing
from app.service.timings import AlignerUnavailable, WordTiming

KEEP_S = 600.0  # a take's timings stay this long after its last sentence is in (the page reads them at once)
MAX_TAKES = 64  # at most this many takes' timings are kept; the oldest go first
MEDIA_TYPE = "application/x-ndjson"


class PageTake:
    """One page take's timings as they come: `items` (the SSE door's `speech.audio.timestamps` events, one per
    sentence, or one with only a `note`: why the take has none), then `done` once the last sentence is in."""

    def __init__(self, owner: Owner, timer: SentenceTimer) -> None:
        self.owner, self.timer = owner, timer
        self.items: list[dict] = []
        self.words: list[WordTiming] = []  # every sentence's, in order: the take's subtitles
        self.done = False
        self.ended_at = 0.0  # time.monotonic() once done
        self._changed = asyncio.Event()  # set (and replaced) at each change: a follower waits on the one it saw
        self._rest: asyncio.Task | None = None

    def push(self, chunk: AudioChunk) -> None:
        """The take's tap: each chunk as the body takes it (never waits)."""
        self.timer.push(chunk)
        self._add(self.timer.ready())
        if chunk.is_final:
            self.end()

    def end(self) -> None:
        """The take's body ended (however): the sentences still being aligned come in the background."""
        if self._rest is None:
            self._rest = asyncio.get_running_loop().create_task(self._finish())

    async def _finish(self) -> None:
        try:
            async for t in self.timer.rest():
                self._add([t])
        finally:
            await self.timer.aclose()
            self.done, self.ended_at = True, time.monotonic()
            self._notify()

    def _add(self, got: list[Timing]) -> None:
        for t in got:
            self.items.append(timestamps_event(t))
            self.words.extend(() if isinstance(t, str) else t.words)
        if got:
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def lines(self, lang: str = "en") -> AsyncIterator[bytes]:
        """Each item as a JSON line as it comes (its note in `lang`), then {"type": "done", "srt", "vtt"} (the
        take's subtitles)."""
        i = 0
        while True:
            changed = self._changed
            while i < len(self.items):
                item = self.items[i]
                yield _line({**item, "note": say(item["note"], lang)} if "note" in item else item)
                i += 1
            if self.done:
                break
            await changed.wait()
        yield _line({"type": "done", "srt": to_srt(self.words), "vtt": to_vtt(self.words)})


def _line(payload: dict) -> bytes:
    return (json.dumps(payload, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


def page_timings_off(cfg: AsrConfig) -> str:
    """Why the page's takes are not aligned (`[asr] page_timings`), or "" when they are. Off on a CPU by default:
    the real aligner costs more CPU than the speech it times (docs/timings.md, "Cost")."""
    if cfg.page_timings == "off":
        return Message("page_timings_off", 'word timings are off for the page ([asr] page_timings = "off")')
    if cfg.page_timings == "auto" and cfg.enabled and resolve_device(cfg.device) == "cpu":
        return Message("page_timings_cpu", "word timings are off for the page on a server without a GPU (aligning "
                       'costs more CPU than the speech it times); [asr] page_timings = "on" turns them on')
    return ""


class Refusing:
    """The aligner of a page whose timings are off: each sentence ends the take's timings with `why`."""

    def __init__(self, why: str) -> None:
        self.why = why

    async def sentence(self, *args, **kwargs) -> None:
        raise AlignerUnavailable(self.why)


class PageTimings:
    """The page takes' timings by request id (at most MAX_TAKES, each until KEEP_S after it is done). `off`: why
    the page's takes are not aligned (page_timings_off), or ""."""

    def __init__(self, service: StudioService, off: str = "") -> None:
        self.service, self.off = service, off
        self.aligner = Refusing(off) if off else service.aligner
        self.takes: OrderedDict[str, PageTake] = OrderedDict()

    def begin(self, request_id: str, owner: Owner, texts: Callable[[], Sequence[str]]) -> PageTake:
        """A new take of `owner` kept under `request_id` (`texts`: its segments' texts, as SentenceTimer reads
        them): `push` each chunk, then `end` it however the take ended."""
        self._prune()
        # off: only the reason comes, no text is read (a cluster's page service has no segments to read)
        take = self.takes[request_id] = PageTake(owner, SentenceTimer(self.aligner, list if self.off else texts))
        return take

    async def speak(self, prepared: Prepared, owner: Owner, speak: Callable[[Tap], Awaitable[Response]]) -> Response:
        """`speak(tap)` (the take's `speech_response`) with its chunks tapped into a new PageTake of `owner`."""
        req = prepared.request
        take = self.begin(req.request_id, owner, lambda: [t.text for t in self.service.synth.segments(req)])
        try:
            response = await speak(take.push)
        except BaseException:  # refused before any audio: no take to time
            self.takes.pop(req.request_id, None)
            await take.timer.aclose()
            raise
        if isinstance(response, ClosingStreamingResponse):  # streamed: the take ends with its body
            body_closed = response.on_close

            async def on_close() -> None:
                try:
                    await body_closed()
                finally:
                    take.end()

            response.on_close = on_close
        else:  # made whole (every chunk tapped), or the client left first
            take.end()
        return response

    def get(self, request_id: str, caller: Caller) -> PageTake:
        """The take `request_id` if `caller` made it (or is the admin); else ApiError 404, as for an unknown id."""
        take = self.takes.get(request_id)
        if take is None or (take.owner != caller.owner and not caller.admin):
            raise ApiError(404, "no page take with this id (unknown, another's, or too old)", param="request_id",
                           code="unknown_request")
        return take

    def _prune(self) -> None:
        now = time.monotonic()
        for rid in [rid for rid, t in self.takes.items() if t.done and now - t.ended_at > KEEP_S]:
            del self.takes[rid]
        while len(self.takes) >= MAX_TAKES:
            self.takes.popitem(last=False)

    def router(self) -> APIRouter:
        router = APIRouter(prefix="/studio", tags=["studio"], include_in_schema=False)

        @router.get("/requests/{request_id}/timings")
        async def studio_timings(request_id: str, request: Request) -> StreamingResponse:
            """The take's word timings as NDJSON, a line per sentence as it is aligned, then a `done` line with
            its SRT and WebVTT; 404 for an unknown id, another caller's take, or one kept too long."""
            take = self.get(request_id, caller_of(request.scope))
            return StreamingResponse(take.lines(lang_of(request)), media_type=MEDIA_TYPE,
                                     headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

        return router
