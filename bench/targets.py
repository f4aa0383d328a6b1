"""What the serving benchmark drives: `InProcess` (a `StudioService` in this process) or `OverHttp`
(a running `python app.py`), both with `start()`, `request(i, text, voice) -> RequestResult`,
`sample()` (memory numbers for `MemoryWatch`), `facts()` and `aclose()`; plus the reference clip and
config helpers. httpx is imported only by `OverHttp.start` (the offline H200 has no httpx).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import secrets
import time
import wave
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

from app.audio import SAMPLES_PER_TOKEN
from app.cli import config_from_cli, config_path
from bench import report as rep
from bench.examples import example_voices

GB = 1e9
MIB = 1024 * 1024


class Reference:
    """The reference clip (16-bit PCM WAV) and its transcript; `perturbed(i)` is a distinct copy of it."""

    def __init__(self, path: Path, transcript: str) -> None:
        with wave.open(str(path)) as w:
            if w.getsampwidth() != 2:
                raise SystemExit(f"{path}: the reference must be 16-bit PCM WAV")
            self.rate, self.channels = w.getframerate(), w.getnchannels()
            self.pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
        self.path, self.transcript = path, transcript

    def perturbed(self, i: int) -> bytes:
        """The clip with 16 samples moved by one LSB (seeded by i): other bytes, so the voice cache misses."""
        pcm = self.pcm.copy()
        rng = np.random.default_rng(i)
        at = rng.integers(0, pcm.size, 16)
        pcm[at] = np.clip(pcm[at].astype(np.int32) + rng.choice([-1, 1], 16), -32768, 32767)
        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            w.setnchannels(self.channels)
            w.setsampwidth(2)
            w.setframerate(self.rate)
            w.writeframes(pcm.tobytes())
        return buf.getvalue()


def default_reference() -> tuple[Path, str]:
    example = example_voices()[0]
    return example["audio"], example["transcript"]


class MemoryWatch:
    """Peaks of a sampler's numbers (gpu_mem_gb, rss_gb, kv_cache_usage) while a level runs."""

    def __init__(self, sample: Callable[[], dict[str, float | None]], interval_s: float) -> None:
        self.sample, self.interval_s = sample, interval_s
        self.peaks: dict[str, float | None] = {}

    def _take(self, s: dict[str, float | None]) -> None:
        for k, v in s.items():
            if v is not None:
                self.peaks[k] = max(v, self.peaks.get(k) or v)

    async def _loop(self) -> None:
        while True:  # a fixed-period sampler (a benchmark timer, not a request path)
            self._take(await asyncio.to_thread(self.sample))
            await asyncio.sleep(self.interval_s)

    @contextlib.asynccontextmanager
    async def watch(self):
        self.peaks = {}
        task = asyncio.create_task(self._loop())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self._take(await asyncio.to_thread(self.sample))  # one more at the level's end


def probe_numbers(sample: dict[str, Any]) -> dict[str, float | None]:
    """gpu_mem_gb (whole device), gpu_total_gb, rss_gb (process tree) and KV usage of a ResourceProbe sample."""
    device, cpu = sample.get("device") or {}, sample.get("cpu") or {}
    return {"gpu_mem_gb": device["used_mib"] * MIB / GB if device.get("used_mib") is not None else None,
            "gpu_total_gb": device["total_mib"] * MIB / GB if device.get("total_mib") is not None else None,
            "rss_gb": cpu["rss_mib"] * MIB / GB if cpu.get("rss_mib") is not None else None,
            "kv_cache_usage_peak": sample.get("kv_cache_usage")}


# --- targets: in-process service or HTTP server -------------------------------------------------------


class InProcess:
    """`StudioService` in this process; requests go straight to `service.stream`."""

    mode = "in-process"

    def __init__(self, args: argparse.Namespace, ref: Reference) -> None:
        self.args, self.ref = args, ref
        self.service: Any = None
        self.voice: Any = None

    async def start(self) -> None:
        from app.service.resources import ResourceProbe

        try:
            from app.service.service import StudioService
        except ImportError as e:  # app/model/onnx_models.py imports onnxruntime at import time
            raise SystemExit(f"the in-process service cannot be imported: {e}. Install {e.name or 'it'} here (the "
                             "offline H200: carry its wheel) or benchmark a server elsewhere with --url") from e

        path = config_path(self.args.config)
        self.config_path = str(path) if path else None
        self.service = StudioService(config_from_cli(self.args))  # as app.py builds it
        await self.service.start()
        if not self.service.ready:
            raise SystemExit(f"the service did not start: {self.service.error}\n(StudioService.start warms up "
                             "with a voice computed from assets/prompt_en.wav: that needs onnxruntime and soundfile)")
        if "saved" in self.args.voice:
            self.voice = await self._saved_voice()
        self._probe = ResourceProbe()

    async def _saved_voice(self) -> Any:
        from app.model.frontend import VoiceFeatures

        if self.args.voice_npz:  # a VoiceStore file (<name>.safetensors) or an np.savez of to_arrays()
            from app.service.voices import VoiceStore

            path = Path(self.args.voice_npz)
            if path.suffix == ".npz":
                with np.load(path, allow_pickle=False) as z:
                    return VoiceFeatures.from_arrays({k: z[k] for k in z.files})
            return VoiceStore(path.parent).load(path.stem)
        return await self.service.voice_from_audio(self.ref.path, self.ref.transcript)

    def facts(self) -> dict[str, Any]:
        return {"model_dir": str(self.service.model_dir), "config": self.config_path, "facts": self.service.facts()}

    def sample(self) -> dict[str, float | None]:
        return probe_numbers(self._probe.sample(self.service.backend))

    async def request(self, i: int, text: str, voice: str) -> rep.RequestResult:
        from app.engine.requests import SynthesisRequest

        t0 = time.perf_counter()
        try:
            features, frontend_s = self.voice, None
            if voice == "new":
                features = await self.service.voice_from_audio(self.ref.perturbed(i), self.ref.transcript)
                frontend_s = time.perf_counter() - t0
            req = SynthesisRequest(text=text, voice=features, seed=i, fixed_tokens=self.args.fixed_tokens)
            arrivals, stats = [], None
            async with contextlib.aclosing(self.service.stream(req)) as chunks:
                async for chunk in chunks:
                    if chunk.samples.size:
                        arrivals.append((time.perf_counter() - t0, int(chunk.samples.size)))
                    stats = chunk.stats or stats
            wall_s = time.perf_counter() - t0
        except Exception as e:  # counted as an error of the level; the sweep goes on
            return rep.RequestResult(index=i, ok=False, error=f"{type(e).__name__}: {e}"[:300])
        extra = {} if stats is None else dict(
            n_tokens=stats.n_tokens, server_ttfa_ms=stats.ttfa_ms, lm_s=stats.lm_s, flow_s=stats.flow_s,
            hift_s=stats.hift_s, first_token_ms=stats.first_token_ms, first_hop_ms=stats.first_hop_ms,
            lm_ms_per_token=stats.lm_ms_per_token, first_wave_ms=stats.first_wave_ms,
            first_hift_ms=stats.first_hift_ms, first_flow_ms=stats.chunk_flow_ms[0] if stats.chunk_flow_ms else None,
            flow_ms_per_frame=[round(ms / n, 4) for ms, n in zip(stats.chunk_flow_ms, stats.chunk_frames, strict=True)
                               if n])
        return rep.result_from_arrivals(i, arrivals, wall_s, frontend_s=frontend_s, **extra)

    async def aclose(self) -> None:
        if self.service is not None:
            await self.service.aclose()


class OverHttp:
    """A running `python app.py`: voices through /v1/voices, speech through /v1/audio/speech (pcm)."""

    mode = "url"

    def __init__(self, args: argparse.Namespace, ref: Reference) -> None:
        self.args, self.ref = args, ref
        self.base = args.url.rstrip("/")
        self.tag = secrets.token_hex(3)
        self.voice_id = args.voice_id
        self._created: list[str] = []
        key = args.api_key or os.environ.get("COSYVOICE_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def start(self) -> None:
        import httpx  # lazily: not on the H200

        from app.service.resources import ResourceProbe

        n = max(self.args.conc) + 4
        self.client = httpx.AsyncClient(base_url=self.base, headers=self.headers, limits=httpx.Limits(
            max_connections=n, max_keepalive_connections=n), timeout=httpx.Timeout(600.0, connect=30.0))
        self._sync = httpx.Client(base_url=self.base, timeout=10.0)
        self._httpx_error = httpx.HTTPError
        try:
            health = (await self.client.get("/health")).json()
        except (httpx.HTTPError, ValueError) as e:  # sweep() closes the target
            raise SystemExit(f"cannot read {self.base}/health: {e}") from e
        if not health.get("ready"):
            raise SystemExit(f"{self.base} is not ready: {health.get('status')}")
        self.health = health
        if "saved" in self.args.voice and not self.voice_id:
            self.voice_id = await self._create_voice(self.ref.path.read_bytes(), f"bench-{self.tag}")
        self._probe = ResourceProbe() if urlparse(self.base).hostname in ("127.0.0.1", "localhost", "::1") else None

    async def _create_voice(self, audio: bytes, name: str) -> str:
        r = await self.client.post("/v1/voices", files={"audio": ("ref.wav", audio, "audio/wav")},
                                   data={"transcript": self.ref.transcript, "name": name})
        if r.status_code != 201:
            raise RuntimeError(f"POST /v1/voices: HTTP {r.status_code} {r.text[:200]}")
        self._created.append(r.json()["id"])
        return r.json()["id"]

    async def _delete_voice(self, voice_id: str) -> None:
        with contextlib.suppress(self._httpx_error):
            await self.client.delete(f"/v1/voices/{voice_id}")
        with contextlib.suppress(ValueError):
            self._created.remove(voice_id)

    def facts(self) -> dict[str, Any]:
        facts = self.health.get("facts") or {}
        return {"url": self.base, "model_dir": facts.get("model_dir"), "facts": facts}

    def sample(self) -> dict[str, float | None]:
        """/health's "memory" (a ResourceProbe sample) where the server gives one; else this machine's
        device (a server on loopback) and the RSS of --server-pid's process tree."""
        out: dict[str, float | None] = {}
        with contextlib.suppress(self._httpx_error, ValueError, TypeError, AttributeError):
            memory = self._sync.get("/health").json().get("memory")
            if memory:
                out = probe_numbers(memory)
        if self._probe is not None and out.get("gpu_mem_gb") is None:
            local = probe_numbers(self._probe.sample())
            out.update(gpu_mem_gb=local["gpu_mem_gb"], gpu_total_gb=local["gpu_total_gb"])
        if self.args.server_pid and out.get("rss_gb") is None:
            from app.service.resources import _process_tree

            out["rss_gb"] = sum(info[1] for info in _process_tree(self.args.server_pid).values()) / GB
        return out

    async def request(self, i: int, text: str, voice: str) -> rep.RequestResult:
        t0 = time.perf_counter()
        voice_id, frontend_s = self.voice_id, None
        try:
            if voice == "new":
                voice_id = await self._create_voice(self.ref.perturbed(i), f"bench-{self.tag}-{i}")
                frontend_s = time.perf_counter() - t0
            body = {"model": "cosyvoice2", "input": text, "voice": voice_id, "response_format": "pcm", "seed": i,
                    "fixed_tokens": self.args.fixed_tokens}
            arrivals, n_bytes, n_samples = [], 0, 0
            async with self.client.stream("POST", "/v1/audio/speech", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise RuntimeError(f"HTTP {r.status_code} {r.text[:200]}")
                hdr = r.headers
                async for piece in r.aiter_raw():
                    n_bytes += len(piece)
                    if n_bytes // 2 > n_samples:  # s16le: a sample may straddle two pieces
                        arrivals.append((time.perf_counter() - t0, n_bytes // 2 - n_samples))
                        n_samples = n_bytes // 2
            wall_s = time.perf_counter() - t0
        except Exception as e:  # HTTP errors, refused connections, ...: an error of the level
            return rep.RequestResult(index=i, ok=False, error=f"{type(e).__name__}: {e}"[:300])
        finally:
            if voice == "new" and voice_id and voice_id != self.voice_id:
                await self._delete_voice(voice_id)
        return rep.result_from_arrivals(
            i, arrivals, wall_s, n_tokens=round(n_samples / SAMPLES_PER_TOKEN), frontend_s=frontend_s,
            server_ttfa_ms=_header_ms(hdr, "X-TTFA-Ms"), queue_ms=_header_ms(hdr, "X-Queue-Ms"))

    async def aclose(self) -> None:
        if hasattr(self, "client"):
            for voice_id in list(self._created):
                await self._delete_voice(voice_id)
            await self.client.aclose()
            self._sync.close()


def _header_ms(headers: Any, name: str) -> float | None:
    try:
        return float(headers[name])
    except (KeyError, ValueError):
        return None
