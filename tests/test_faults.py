"""Faults never lose the service: disconnects leave nothing behind, an out-of-memory request is refused
with advice, a killed engine is reported and restarted; plus the login and rate-limit options.

Three tiers: pure units and in-process FastAPI (no engine); an in-process `StudioService` on the
torch LM backend (out-of-memory injected into the real token2wav worker and LM stream); and `python app.py`
with the real vLLM CPU engine (100 disconnects, then kill -9 of its EngineCore), the server shared with
test_formats and test_prometheus (conftest.py's studio_cpu), which then meet the restarted engine.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from studio import save_voice

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = json.loads((REPO / "assets" / "examples.json").read_text(encoding="utf-8"))
EN_WAV, EN_TRANSCRIPT = REPO / "assets" / "prompt_en.wav", EXAMPLES["voices"][0]["transcript"]
MARKER = "Zanzibar quokka marmalade"  # must never appear in a log
# long enough (many segments) that no request ends by itself before its client leaves
LONG_TEXT = MARKER + ". " + " ".join(["This long sentence keeps the model talking for quite a while."] * 25)
N_DISCONNECTS = 100  # 30 /v1 streams, 30 /studio streams, 20 Stops, 20 closed tabs
# RSS of the app + engine processes (~3.4 GiB). Measured on 2 cores: the first ~40 Gradio streams of
# a process grow the app by ~150 MiB (ffmpeg/HLS, allocator arenas), then growth flattens to 0-16 MiB
# per 20 requests; the vLLM CPU worker adds a few MiB (oneDNN's shape-keyed primitive cache, bounded).
# Measured after the 16 warm-up requests: +110 MiB after 100, the last 50 adding +26 (docs/reliability.md
# has more runs). A per-request leak grows linearly: the second-half bound is the sharper check.
RSS_TOLERANCE_MIB = 256  # after the 100, vs. the baseline after the warm-up (7.5 %)
RSS_SECOND_HALF_MIB = 96  # what the last 50 may add


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


# --- units: rate limiter, client IP, auth parsing, OOM classification, weights_only ----------------------


def test_rate_limiter_token_bucket():
    from app.server.limits import RateLimiter

    now = [0.0]
    rl = RateLimiter(6, max_clients=2, clock=lambda: now[0])  # 6 per minute = one token every 10 s
    assert [rl.acquire("a") for _ in range(6)] == [0.0] * 6  # a burst up to the limit
    assert rl.acquire("a") == pytest.approx(10.0)  # then one per 10 s
    now[0] = 5.0
    assert rl.acquire("a") == pytest.approx(5.0) and rl.acquire("b") == 0.0  # refused takes nothing; b is separate
    now[0] = 10.0
    assert rl.acquire("a") == 0.0 and rl.acquire("a") > 0
    rl.acquire("c")
    assert len(rl) == 2  # the longest idle client is forgotten


def client_seen(server, scope: dict) -> str:
    """The client address the app behind `ProxyClient` (for `server`, a ServerConfig) reads in `scope`."""
    from app.server.identity import ProxyClient

    seen = {}

    async def app(s, _receive, _send):
        seen.update(s)

    asyncio.run(ProxyClient(app, server)({"type": "http", **scope}, None, None))
    return seen["client"][0]


def test_client_trusts_forwarded_for_only_behind_a_proxy():
    from app.config import load_config

    def server(**sets):
        return load_config(None, {f"server.{k}": v for k, v in sets.items()}).server

    scope = {"client": ("10.0.0.9", 5000), "headers": [(b"x-forwarded-for", b"1.2.3.4, 203.0.113.7")]}
    assert client_seen(server(), scope) == "10.0.0.9"
    assert client_seen(server(trust_proxy=True), scope) == "203.0.113.7"  # the entry the proxy wrote, not the client's
    assert client_seen(server(trust_proxy=True), {"client": ("10.0.0.9", 1), "headers": []}) == "10.0.0.9"
    assert client_seen(server(trusted_proxies="10.0.0.0/8"), scope) == "203.0.113.7"
    chain = {**scope, "headers": [(b"x-forwarded-for", b"1.2.3.4"), (b"x-forwarded-for", b"203.0.113.7, 10.0.0.3")]}
    assert client_seen(server(trusted_proxies="10.0.0.0/8"), chain) == "203.0.113.7"  # past a second trusted proxy
    assert client_seen(server(trusted_proxies="10.9.9.9"), scope) == "10.0.0.9"  # an untrusted peer's header
    assert client_seen(server(trusted_proxies="10.0.0.9"), {**scope, "type": "websocket"}) == "203.0.113.7"  # WS too


def test_auth_setting_is_checked():
    from app.config import ConfigError, load_config

    assert load_config(None, {"server.auth": "a:b:c, bob:x"}).server.auth_users == [("a", "b:c"), ("bob", "x")]
    for bad in ("alice", ":pw", "alice:", "a:b,c"):
        with pytest.raises(ConfigError, match=r"server\.auth") as e:
            load_config(None, {"server.auth": bad})
        assert bad not in str(e.value)  # a password never lands in a message or a log
    with pytest.raises(ConfigError):
        load_config(None, {"server.rate_limit_per_minute": -1})


def test_out_of_memory_is_recognised():
    import torch

    from app.service.take_end import is_out_of_memory

    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    try:
        try:
            raise RuntimeError("CUDA error: out of memory")
        except RuntimeError as inner:
            raise RuntimeError("EngineGenerateError") from inner  # vLLM wraps the cause
    except RuntimeError as outer:
        assert is_out_of_memory(outer)
    assert not is_out_of_memory(ValueError("the text is empty"))


def test_until_stopped_leaves_no_chunk_running():
    """The page's Stop ends a take while a chunk is being made; a consumer cancelled or closed meanwhile leaves
    the take's generator closed too (its finally, which aborts the LM request, has run), never running."""
    import contextlib

    from app.service.take_end import until_stopped

    async def scenario() -> None:
        closed: list[str] = []

        async def take(name: str):
            try:
                for i in range(100):
                    await asyncio.sleep(0.05)  # a chunk being made
                    yield i
            finally:
                closed.append(name)

        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.12, stop.set)
        async with contextlib.aclosing(take("stopped")) as made:
            got = [c async for c in until_stopped(made, stop)]
        assert got == [0, 1] and closed == ["stopped"]  # ended at Stop, mid-chunk

        async def consume(made) -> None:
            async with contextlib.aclosing(made), contextlib.aclosing(until_stopped(made, asyncio.Event())) as chunks:
                async for _ in chunks:
                    pass

        task = asyncio.create_task(consume(take("cancelled")))
        await asyncio.sleep(0.12)
        task.cancel()  # a client gone mid-chunk
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert closed == ["stopped", "cancelled"]
        assert [c async for c in until_stopped(take("plain"), None)] == list(range(100))

    asyncio.run(scenario())


def test_checkpoints_load_with_weights_only():
    calls = []
    for path in (REPO / "app").rglob("*.py"):
        for m in re.finditer(r"torch\.load\(([^)]*)\)", path.read_text(encoding="utf-8")):
            calls.append((path.name, m.group(1)))
    assert calls and all("weights_only=True" in args for _, args in calls), calls
    # no pickle from a NumPy file either (saved voices are safetensors; bench/ may read its own .npz)
    np_loads = [m.group(1) for path in (REPO / "app").rglob("*.py")
                for m in re.finditer(r"np\.load\(([^)]*)\)", path.read_text(encoding="utf-8"))]
    assert all("allow_pickle=False" in args for args in np_loads), np_loads


# --- in-process server without an engine: login and rate limit ---------------------------------------


@pytest.fixture()
def locked_app(tmp_path):
    from fastapi.testclient import TestClient

    from app.config import load_config
    from app.server.main import build_server

    cfg = load_config(None, {"server.auth": "alice:s3cret:pw", "server.rate_limit_per_minute": 4,
                             "server.trust_proxy": True, "server.voices_dir": str(tmp_path / "v"),
                             "model.dir": str(tmp_path / "missing")})
    return TestClient(build_server(cfg), raise_server_exceptions=False)  # lifespan not run: never ready


def _basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_login_guards_page_studio_and_api(locked_app):
    c = locked_app
    speech = {"model": "cosyvoice2", "input": "hi", "voice": "x"}
    for path, body in (("/studio/speech", {"text": "hi"}), ("/v1/audio/speech", speech)):
        r = c.post(path, json=body, headers={"X-Forwarded-For": f"10.1.0.{len(path)}"})
        assert r.status_code == 401 and error_of(r)["code"] == "login_required", path
        assert r.headers["www-authenticate"].startswith("Basic")
    assert c.get("/gradio_api/info").status_code == 401 and c.get("/config").status_code == 401  # Gradio's own
    assert c.get("/v1/models", headers=_basic("alice", "wrong")).status_code == 401
    assert c.get("/v1/models", headers=_basic("alice", "s3cret:pw")).status_code == 200  # Basic on /v1 (no api_key)
    assert c.get("/health").status_code == 503  # probes
    assert c.get("/v1/openapi.json").status_code == 401 and c.get("/metrics").status_code == 401  # follow the login
    assert c.get("/v1/openapi.json", headers=_basic("alice", "s3cret:pw")).status_code == 200
    r = c.post("/login", data={"username": "alice", "password": "s3cret:pw"})  # the page's login form
    assert r.status_code == 200
    assert c.get("/gradio_api/info").status_code == 200
    r = c.post("/studio/speech", json={"text": "hi"})  # the page's cookie opens /studio
    assert r.status_code == 503 and error_of(r)["code"] == "not_ready"


def test_rate_limit_per_client(locked_app):
    c = locked_app
    auth = _basic("alice", "s3cret:pw")
    body = {"model": "cosyvoice2", "input": "hi", "voice": "x"}
    me = {**auth, "X-Forwarded-For": "spoofed, 198.51.100.1"}
    codes = [c.post("/v1/audio/speech", json=body, headers=me).status_code for _ in range(5)]
    assert codes == [503] * 4 + [429]  # 4 per minute pass (to "not ready"), the 5th is refused
    r = c.post("/v1/audio/speech", json=body, headers=me)
    err = error_of(r)
    assert r.status_code == 429 and err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
    assert 1 <= int(r.headers["retry-after"]) <= 15
    other = {**auth, "X-Forwarded-For": "spoofed, 198.51.100.2"}  # another client has its own bucket
    assert c.post("/v1/audio/speech", json=body, headers=other).status_code == 503
    assert c.get("/v1/models", headers=me).status_code == 200  # only synthesis requests count
    assert c.get("/health", headers=me).status_code == 503


# --- in-process service (torch LM backend): out of memory is refused, then the next request works ------


def test_out_of_memory_is_refused_with_advice_and_next_request_works(tiny_model_dir, tmp_path, monkeypatch):
    import gradio as gr
    import torch

    from app.config import CONFIG_DIR, load_config
    from app.engine.requests import SynthesisRequest
    from app.model.token2wav import Token2WavStream
    from app.server.errors import ApiError
    from app.server.speech import speech_response
    from app.service.service import OOM_ADVICE, GpuOutOfMemoryError, StudioService
    from app.ui.handlers import Handlers

    cfg = load_config(CONFIG_DIR / "cpu.toml", {"model.dir": str(tiny_model_dir), "engine.backend": "torch",
                                               "server.voices_dir": str(tmp_path / "v")})
    service = StudioService(cfg)
    real_finish = Token2WavStream.finish  # mel -> wave of one chunk, on the token2wav scheduler's worker
    fail = {"t2w": 0}

    def finish_or_oom(self, *args, **kwargs):  # the next `fail["t2w"]` chunks run out of memory
        if fail["t2w"] > 0:
            fail["t2w"] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB")
        return real_finish(self, *args, **kwargs)

    monkeypatch.setattr(Token2WavStream, "finish", finish_or_oom)

    async def collect(req):
        n = 0
        async for chunk in service.stream(req):
            n += chunk.samples.size
        return n

    async def scenario():
        await service.start()
        assert service.ready, service.status
        voice = await service.voice_from_audio(EN_WAV, EN_TRANSCRIPT)
        req = SynthesisRequest(text="Hello there, how are you today?", voice=voice, seed=1)
        fail["t2w"] = 1  # token2wav runs out of memory
        with pytest.raises(GpuOutOfMemoryError, match=re.escape(OOM_ADVICE)):
            await collect(req)
        assert service.n_out_of_memory == 1 and service.metrics.active_streams == 0
        assert await collect(req) > 0  # the very next request works

        real_lm = service.backend.stream  # the LM (vLLM wraps the CUDA error in its own)

        async def lm_oom(lm_req):
            try:
                raise RuntimeError("CUDA error: out of memory")
            except RuntimeError as e:
                raise RuntimeError("EngineGenerateError") from e
            yield []  # an async generator, like the real one

        service.backend.stream = lm_oom
        with pytest.raises(GpuOutOfMemoryError):
            await collect(req)
        service.backend.stream = real_lm
        fail["t2w"] = 1  # over HTTP: a 503 with advice before any audio
        with pytest.raises(ApiError) as e:
            await speech_response(service, req, "pcm")
        assert (e.value.status, e.value.code) == (503, "gpu_out_of_memory") and e.value.headers["Retry-After"]
        fail["t2w"] = 1  # through the Gradio API: a gr.Error with the advice
        handlers = Handlers(service)
        with pytest.raises(gr.Error, match="out of memory: try a shorter text"):
            async for _ in handlers.synthesize(req.text, {"path": str(EN_WAV)}, EN_TRANSCRIPT, "zero_shot", "", "",
                                               1, 1.0, True):
                pass
        assert service.n_out_of_memory == 4 and service.health()["faults"]["out_of_memory"] == 4
        assert service.health()["ready"] and await collect(req) > 0
        assert service.metrics.active_streams == 0 and service.health()["lm_unfinished"] == 0
        await service.aclose()

    asyncio.run(scenario())


# --- the real server: 100 disconnects, no user text in the log, engine kill -> restart ------------------


@pytest.fixture(scope="module")
def server(studio_cpu):
    """(base_url, tmp with server.log) of the shared `python app.py` on cpu.toml, 4 running (conftest.py)."""
    return studio_cpu


@pytest.fixture(scope="module")
def voice(server):
    return save_voice(server[0], "faults")["id"]


def health(server) -> dict:
    return httpx.get(server[0] + "/health", timeout=10).json()


def wait_idle(server, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while (h := health(server))["lm_unfinished"] or h["active_streams"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.1)
    return h


def server_rss_mib(base: str) -> dict[str, float]:
    from bench.soak import rss_mib, server_process

    return rss_mib(server_process(base))


class Disconnector:
    """The four ways a listener leaves early, each after the first audio reached it."""

    def __init__(self, base: str, voice: str) -> None:
        self.base, self.voice = base, voice
        self.local = threading.local()  # a gradio_client per thread: one Client's concurrent jobs can hang
        config = httpx.get(base + "/config", timeout=30).json()
        self.fn_index = next(d["id"] for d in config["dependencies"] if d.get("api_name") == "synthesize")
        with EN_WAV.open("rb") as f:  # API file inputs must be uploads (server paths are refused)
            r = httpx.post(base + "/gradio_api/upload", files={"files": (EN_WAV.name, f, "audio/wav")}, timeout=30)
        self.uploaded = r.json()[0]
        self.seed = 0
        self.lock = threading.Lock()

    def next_seed(self) -> int:
        with self.lock:
            self.seed += 1
            return self.seed

    def http(self, path: str, body: dict) -> None:
        """A dropped HTTP stream: read the first bytes, then close the connection."""
        with httpx.stream("POST", self.base + path, json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            assert next(r.iter_raw())

    def v1(self) -> None:
        self.http("/v1/audio/speech", {"input": LONG_TEXT, "voice": self.voice, "response_format": "pcm",
                                       "seed": self.next_seed()})

    def studio(self) -> None:  # the page's player (its Stop aborts this fetch)
        self.http("/studio/speech", {"text": LONG_TEXT, "prompt_audio": str(EN_WAV), "prompt_text": EN_TRANSCRIPT,
                                     "mode": "zero_shot", "seed": self.next_seed()})

    def stop(self) -> None:
        """gradio_client's cancel: Gradio cancels the running event."""
        from gradio_client import Client, handle_file

        if not hasattr(self.local, "client"):
            self.local.client = Client(self.base + "/", verbose=False)
        job = self.local.client.submit(text=LONG_TEXT, prompt_audio=handle_file(str(EN_WAV)), prompt_text=EN_TRANSCRIPT,
                                 mode="zero_shot", instruct_text="", voice="", seed=self.next_seed(), speed=1.0,
                                 stream=True, api_name="/synthesize")
        deadline = time.monotonic() + 120
        while not job.outputs():  # the first chunk reached the client
            assert time.monotonic() < deadline and not job.done(), job.status()
            time.sleep(0.05)
        job.cancel()
        # gradio_client shares one event stream per Client; the server closes it once the session has no event
        # left. A submit that lands after that close is sent but before the reader has read it is dropped with
        # that reader (its job ends in CancelledError), so the next submit waits for the reader to end.
        while self.local.client.stream_open:
            assert time.monotonic() < deadline, "the cancelled event's stream stayed open"
            time.sleep(0.05)

    def closed_tab(self) -> None:
        """A Gradio API client that goes: its event stream (SSE) and its heartbeat connection go away mid-generation."""
        session = secrets.token_hex(8)
        # the endpoint's inputs, as a hand-made client sends them (the 10th: Dialogue off)
        data = [LONG_TEXT, {"path": self.uploaded, "meta": {"_type": "gradio.FileData"}}, EN_TRANSCRIPT, "zero_shot",
                "", "", self.next_seed(), 1.0, True, False]
        with httpx.Client(base_url=self.base, timeout=120) as http, \
                http.stream("GET", f"/gradio_api/heartbeat/{session}"):  # what an open page holds
            r = http.post("/gradio_api/queue/join", json={"data": data, "fn_index": self.fn_index,
                                                          "session_hash": session, "trigger_id": None,
                                                          "event_data": None})
            assert r.status_code == 200, r.text
            with http.stream("GET", "/gradio_api/queue/data", params={"session_hash": session}) as sse:
                for line in sse.iter_lines():
                    if '"process_generating"' in line or '"process_streaming"' in line:
                        return  # the first chunk arrived: close the tab (both connections)
                    assert '"process_completed"' not in line, line
        raise AssertionError("the event stream ended before any audio")


def test_disconnects_free_everything(server, voice):
    d = Disconnector(server[0], voice)
    kinds = [d.v1, d.studio, d.stop, d.closed_tab]
    mix = [d.v1, d.studio, d.v1, d.studio, d.stop, d.closed_tab, d.v1, d.studio, d.stop, d.closed_tab]  # 3:3:2:2

    def settled() -> tuple[dict, float]:
        h = wait_idle(server)
        time.sleep(1)
        rss = server_rss_mib(server[0])
        by_process.append({k: round(v) for k, v in rss.items() if k != "total"})  # "pid name": MiB
        return h, rss["total"]

    by_process: list[dict[str, int]] = []
    rss = []
    # one pool throughout: its 4 threads keep their gradio_client (Disconnector.stop) instead of making new ones
    with ThreadPoolExecutor(4) as pool:  # 4 at a time: the HTTP slots and the page's concurrency_limit
        list(pool.map(lambda i: kinds[i % 4](), range(16)))  # warm-up: first-use allocations are not a leak
        h0, rss0 = settled()
        t0 = time.monotonic()
        for _ in range(2):
            list(pool.map(lambda i: mix[i % len(mix)](), range(N_DISCONNECTS // 2)))
            h, total = settled()
            rss.append(total)
            assert h["lm_unfinished"] == 0 and h["active_streams"] == 0 and h["http_waiting"] == 0
        took_s = time.monotonic() - t0
    before, after = h0["requests"]["outcomes"], h["requests"]["outcomes"]
    cancelled = after["cancelled"] - before["cancelled"]
    print(f"\n{N_DISCONNECTS} disconnects in {took_s:.1f} s: cancelled {cancelled}, lm_unfinished "
          f"{h['lm_unfinished']}, active_streams {h['active_streams']}; RSS (app + engine) MiB: baseline "
          f"{rss0:.0f}, after 50 {rss[0]:.0f}, after 100 {rss[1]:.0f}; by process {by_process}")
    assert cancelled == N_DISCONNECTS and after["ok"] == before["ok"] and after["error"] == before["error"]
    assert rss[1] - rss0 < RSS_TOLERANCE_MIB and rss[1] - rss[0] < RSS_SECOND_HALF_MIB, (rss0, rss)
    r = httpx.post(server[0] + "/v1/audio/speech", json={"input": "Hello there.", "voice": voice,
                                                         "response_format": "pcm", "seed": 1}, timeout=120)
    assert r.status_code == 200 and len(r.content) > 0  # still serving


def test_no_user_text_in_the_log(server):
    log = (server[1] / "server.log").read_text(encoding="utf-8", errors="replace")
    assert "Application startup complete" in log or "ready in" in log
    assert MARKER not in log and "keeps the model talking" not in log


def test_the_pages_stop_ends_generation_when_it_arrives(server, voice):
    """POST /studio/requests/{id}/stop ends the take at once, not when the page hangs up (which a loaded box or a
    browser's full connection pool delays): the body ends and the engine holds nothing while the client still
    listens; the take counts as cancelled (its record: stopped)."""
    base = server[0]
    before = health(server)["requests"]["outcomes"]
    with httpx.Client(timeout=120) as c, c.stream("POST", f"{base}/studio/speech",
                                                  json={"text": LONG_TEXT, "voice": voice, "seed": 1}) as r:
        assert r.status_code == 200
        pieces = r.iter_bytes()
        received = len(next(pieces))
        t0 = time.monotonic()
        assert httpx.post(f"{base}/studio/requests/{r.headers['x-request-id']}/stop", timeout=30).status_code == 200
        for piece in pieces:  # what was on its way, then the end: the client never hung up
            received += len(piece)
        ended_s = time.monotonic() - t0
        assert health(server)["lm_unfinished"] == 0
    assert ended_s < 10 and received < 24000 * 2 * 60, (ended_s, received)  # far from the whole LONG_TEXT
    after = wait_idle(server)["requests"]["outcomes"]
    assert after["cancelled"] == before["cancelled"] + 1 and after["ok"] == before["ok"], (before, after)


def test_an_unwritable_voice_store_is_refused_clearly_and_saved_voices_still_speak(server, voice):
    """The voices folder made immutable (chattr +i: root may not write it either): save, overwrite, delete and
    import on /v1 and the page's save are refused (507 `voices_unwritable`) naming no path, one log line each
    and no traceback; the saved voice still speaks."""
    import shutil
    import subprocess

    from gradio_client import Client, handle_file
    from gradio_client.exceptions import AppError

    base, tmp = server
    folder = tmp / "voices"
    exported = httpx.get(f"{base}/v1/voices/{voice}/export", timeout=60).content
    if shutil.which("chattr") is None or subprocess.run(["chattr", "-R", "+i", str(folder)]).returncode:
        pytest.skip("chattr +i is not available on this file system")
    before = len((tmp / "server.log").read_text(encoding="utf-8", errors="replace"))
    try:
        def save(name: str, **more) -> httpx.Response:
            return httpx.post(f"{base}/v1/voices", files={"audio": ("ref.wav", EN_WAV.read_bytes(), "audio/wav")},
                              data={"transcript": EN_TRANSCRIPT, "name": name, **more}, timeout=120)

        answers = [save("ro-new"), save(voice, overwrite="true"), httpx.delete(f"{base}/v1/voices/{voice}"),
                   httpx.post(f"{base}/v1/voices/import", files={"file": ("v.cvvoice", exported)},
                              data={"name": "ro-imported"}, timeout=120)]
        for r in answers:
            assert r.status_code == 507 and r.json()["error"]["code"] == "voices_unwritable", r.text
            assert str(tmp) not in r.text and "/" not in r.json()["error"]["message"], r.text
        with pytest.raises(AppError, match="voices folder") as page:
            Client(base + "/", verbose=False).predict(name="ro-page", prompt_audio=handle_file(str(EN_WAV)),
                                                      prompt_text=EN_TRANSCRIPT, api_name="/save_voice")
        assert str(tmp) not in str(page.value)
        r = httpx.post(f"{base}/v1/audio/speech", json={"input": "Hello there.", "voice": voice,
                                                          "response_format": "pcm", "seed": 1}, timeout=120)
        assert r.status_code == 200 and len(r.content) > 0  # the saved voice speaks
        assert voice in {v["id"] for v in httpx.get(f"{base}/v1/voices").json()["data"]}
    finally:
        subprocess.run(["chattr", "-R", "-i", str(folder)], check=True)
    log = (tmp / "server.log").read_text(encoding="utf-8", errors="replace")[before:]
    assert "Traceback" not in log and log.count("cannot write the voices folder") == 5, log[-3000:]


def test_engine_death_is_reported_then_the_engine_restarts(server, voice):
    """kill -9 of the EngineCore (bench/engine_kill.py's drill): /health says so within seconds,
    /v1 and the page refuse at once with "engine died", the engine restarts in-process and serves."""
    from gradio_client import Client, handle_file
    from gradio_client.exceptions import AppError

    from bench.engine_kill import drill

    client = Client(server[0] + "/", verbose=False)

    def page_refuses() -> None:
        with pytest.raises(AppError, match="engine died"):
            client.predict(text="Hello.", prompt_audio=handle_file(str(EN_WAV)), prompt_text=EN_TRANSCRIPT,
                           mode="zero_shot", instruct_text="", voice="", seed=1, speed=1.0, stream=True,
                           api_name="/synthesize")

    speech = {"input": "Hello there, how are you?", "voice": voice, "response_format": "pcm", "seed": 1}
    report = drill(server[0], speech, while_dead=page_refuses)
    assert "SIGKILL" in report["dead_status"] and report["refused_in_s"] < 5, report
    assert report["faults"] == {"out_of_memory": 0, "engine_deaths": 1, "engine_restarts": 1}
    assert report["status"] == "ready" and health(server)["facts"]["running"]
    *_, details = client.predict(text="Hello.", prompt_audio=handle_file(str(EN_WAV)),
                                 prompt_text=EN_TRANSCRIPT, mode="zero_shot", instruct_text="", voice="",
                                 seed=1, speed=1.0, stream=False, api_name="/synthesize")
    assert details["audio_samples"] > 0  # the page serves again too
    print(f"\nengine kill: detected in {report['detect_s']:.2f} s, ready again {report['ready_s']:.1f} s, "
          f"first request served {report['recover_s']:.1f} s after the kill")


def test_a_space_trusts_its_proxy_for_client_addresses(monkeypatch):
    """On a Space the app sees the proxy's internal address: "auto" trusted_proxies becomes the private
    networks there (else every visitor would be one client), and stays "nobody" elsewhere; an explicit
    value wins; a malformed one is refused."""
    import argparse

    from app.cli import add_config_args, config_from_cli

    def cli(*argv: str):
        return config_from_cli(add_config_args(argparse.ArgumentParser(), server=True).parse_args(list(argv)))
    from app.config import ConfigError, load_config

    scope = {"client": ("10.16.3.80", 1), "headers": [(b"x-forwarded-for", b"198.51.100.4")]}
    monkeypatch.delenv("SYSTEM", raising=False)
    here = cli()
    assert here.server.proxy_networks == () and client_seen(here.server, scope) == "10.16.3.80"
    monkeypatch.setenv("SYSTEM", "spaces")
    space = cli()
    assert client_seen(space.server, scope) == "198.51.100.4"
    public_peer = {"client": ("203.0.113.9", 1), "headers": scope["headers"]}  # not the Space's proxy
    assert client_seen(space.server, public_peer) == "203.0.113.9"
    mine = cli("--set", 'server.trusted_proxies="10.9.9.9"')
    assert client_seen(mine.server, scope) == "10.16.3.80"
    with pytest.raises(ConfigError, match="trusted_proxies"):
        load_config(overrides={"server.trusted_proxies": "not-an-address"})
