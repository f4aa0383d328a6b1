"""Shared fixtures: the parity fixture set (COSYVOICE_PARITY_DIR) and its golden arrays."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PARITY_DIR = REPO.parent / "shared" / "fixtures" / "parity_v1"
# tests never download (a blank transcript would fetch Whisper, a missing model folder CosyVoice2) and
# see the offline path on every machine, CI included; the servers they start inherit this
os.environ["HF_HUB_OFFLINE"] = "1"


def parity_dir() -> Path:
    return Path(os.environ.get("COSYVOICE_PARITY_DIR", DEFAULT_PARITY_DIR)).resolve()


@pytest.fixture(scope="session")
def parity() -> Path:
    """The fixture set's root; every parity test skips with a reason where it is absent."""
    root = parity_dir()
    if not (root / "manifest.json").is_file():
        pytest.skip(f"parity fixture set not found at {root} (set COSYVOICE_PARITY_DIR)")
    return root


@pytest.fixture(scope="session")
def parity_model_dir(parity: Path) -> Path:
    return parity / json.loads((parity / "manifest.json").read_text())["model_dir"]


@pytest.fixture(scope="session")
def manifest(parity: Path) -> dict:
    return json.loads((parity / "manifest.json").read_text())


@pytest.fixture(scope="session")
def golden(parity: Path):
    """golden('flow') -> dict of arrays from flow.npz (loaded once per file)."""
    cache: dict[str, dict[str, np.ndarray]] = {}

    def load(name: str) -> dict[str, np.ndarray]:
        if name not in cache:
            with np.load(parity / f"{name}.npz", allow_pickle=False) as z:
                cache[name] = {k: z[k] for k in z.files}
        return cache[name]

    return load


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny models on a 2-core box: OpenMP across 2 threads is slower than 1 for these ops."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A `make_model --size tiny` folder, built once per test session."""
    from app.model.random.make import make_model
    from app.model.random.sizes import TINY

    out = tmp_path_factory.mktemp("models") / "tiny"
    make_model(out, TINY, seed=0)
    return out


def pytest_sessionfinish(session, exitstatus):
    """COSYVOICE_ERROR_REPORT=path: write every bound's measured value (tests/tolerances.py)."""
    path = os.environ.get("COSYVOICE_ERROR_REPORT")
    if path:
        from tolerances import write_report

        write_report(path)


# --- parity inputs several test files share --------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt(golden):
    """The official flow prompt of the fixture set (tokens, mel, x-vector) as a FlowPrompt."""
    import torch

    from app.model.flow_calls import FlowPrompt

    f = golden("flow")
    return FlowPrompt(tokens=torch.from_numpy(f["prompt_token"]).long(), mel=torch.from_numpy(f["prompt_feat"]),
                      embedding=torch.from_numpy(f["embedding"]))


@pytest.fixture(scope="module")
def tokens(golden):
    """The official streaming case's speech tokens, [1, N] int64."""
    import torch

    return torch.from_numpy(golden("stream")["tokens"]).long()


@pytest.fixture(scope="module")
def voice(parity, parity_model_dir, manifest):
    """The e2e case's reference as our frontend makes it (VoiceFeatures; tests with a server define their own)."""
    from app.model.loader import load_model

    e2e = manifest["e2e"]
    return load_model(parity_model_dir, device="cpu").frontend.voice_from_audio(parity / e2e["prompt_wav"],
                                                                               e2e["prompt_text"])



# --- `python app.py` servers shared across test files ------------------------------------------------------
# A server start costs ~45 s of this 2-core box, so one server per configuration serves every file asking for
# it: its fixture is started on first use, the files sharing it are run next to each other
# (pytest_collection_modifyitems) and it stops after its last test (pytest_runtest_teardown), so at most one
# shared server runs at a time. Tests on a shared server keep apart by their own voice names and log offsets.
# Ask for these fixtures by argument (not request.getfixturevalue): the last-user check reads item.fixturenames.
SHARED_SERVERS: dict[str, dict[str, str]] = {
    # cpu.toml's queue (4 running), stated: engine-kill and disconnect drills count on it; Whisper on the CPU, the
    # random tiny one (`studio_cpu` adds its folder as asr.model_id): test_agent_doors' word timings
    "studio_cpu": {"server.concurrency_limit": "4", "asr.device": '"cpu"'},
    # the browser's config: bfloat16 as a user's CPU runs it, no Whisper download; texts up to 4,000 characters
    # (the standard player's Stop needs a take still being made when its HLS <audio> has started)
    "studio_bf16": {"vllm.dtype": '"bfloat16"', "model.download": "false", "limits.max_text_chars": "4000"},
    # a small queue (2 running, 1 waiting: the queue-full tests need four requests), 2 MB uploads
    "studio_queue": {"server.concurrency_limit": "2", "server.queue_max_size": "1", "limits.max_upload_mb": "2"},
    # 1 MB uploads (an oversized case stays small) and short takes (fuzzed text answers within seconds)
    "studio_small": {"limits.max_upload_mb": "1", "sampling.max_len_ratio": "4"},
    # a public page behind a proxy (127.0.0.1 trusted): private voices, one stream per client, raised input
    # limits, Gradio's cache cleaned every 2 s, no Whisper download (test_owners.py, test_examples.py)
    "studio_public": {"voices.scope": '"private"', "server.concurrency_limit": "4",
                      "server.max_streams_per_client": "1", "limits.max_text_chars": "2400",
                      "limits.max_transcript_chars": "1200", "limits.max_instruct_chars": "600",
                      "server.trusted_proxies": '"127.0.0.1"', "ui.cache_cleanup_s": "2", "model.download": "false"},
    # Whisper on the CPU: the rigged tiny one (`studio_asr` adds its folder as asr.model_id; test_asr.py, test_i18n.py)
    "studio_asr": {"asr.device": '"cpu"', "model.download": "false"},
}
_running: dict[str, contextlib.ExitStack] = {}


def _shared_server(name: str, tiny_model_dir: Path, tmp_path_factory,
                   more: dict[str, str] | None = None) -> Iterator[tuple[str, Path]]:
    """(base_url, tmp) of the shared server `name` (`more`: settings known only at start); tmp holds its voices/
    and server.log."""
    from studio import run_studio

    stack = _running[name] = contextlib.ExitStack()
    sets = {**SHARED_SERVERS[name], **(more or {})}
    try:
        yield stack.enter_context(run_studio(tiny_model_dir, tmp_path_factory.mktemp(name), sets))
    finally:
        stack.close()
        _running.pop(name, None)


def _shared_fixture(name: str):
    @pytest.fixture(scope="session", name=name)
    def fixture(tiny_model_dir, tmp_path_factory):
        yield from _shared_server(name, tiny_model_dir, tmp_path_factory)

    return fixture


studio_bf16, studio_queue, studio_small, studio_public = map(_shared_fixture, list(SHARED_SERVERS)[1:5])


@pytest.fixture(scope="session")
def studio_cpu(tiny_model_dir, tmp_path_factory):
    """The shared CPU server; its Whisper (the aligner's) is the random tiny one: its word times are arbitrary but
    whole (one per word, monotone, inside the take); the page's takes are aligned too (`page_timings`, off by
    default on a CPU). Nothing on this server transcribes a reference."""
    from app.model.random.whisper import make_tiny_whisper

    random = make_tiny_whisper(tmp_path_factory.mktemp("whisper") / "random", seed=1)
    yield from _shared_server("studio_cpu", tiny_model_dir, tmp_path_factory,
                              {"asr.model_id": json.dumps(str(random)), "asr.page_timings": '"on"'})


@pytest.fixture(scope="session")
def studio_asr(tiny_model_dir, tmp_path_factory):
    """The shared server whose Whisper is the rigged tiny one (it always hears `RIGGED_WORD`)."""
    from app.model.random.whisper import make_tiny_whisper

    rigged = make_tiny_whisper(tmp_path_factory.mktemp("whisper") / "rigged", rigged=True)
    yield from _shared_server("studio_asr", tiny_model_dir, tmp_path_factory, {"asr.model_id": json.dumps(str(rigged))})


def pytest_collection_modifyitems(items):
    """Files sharing a server run next to each other, at the place of the first one; others keep their order."""
    files = list(dict.fromkeys(item.nodeid.split("::")[0] for item in items))
    uses: dict[str, set[str]] = {f: set() for f in files}
    for item in items:
        uses[item.nodeid.split("::")[0]] |= SHARED_SERVERS.keys() & set(getattr(item, "fixturenames", ()))
    first = {name: next(i for i, f in enumerate(files) if name in uses[f])
             for name in SHARED_SERVERS if any(name in u for u in uses.values())}
    anchor = {f: min([i, *(first[n] for n in uses[f])]) for i, f in enumerate(files)}
    order = {f: (anchor[f], i) for i, f in enumerate(files)}
    items.sort(key=lambda item: order[item.nodeid.split("::")[0]])


@pytest.hookimpl(trylast=True)  # after the item's own fixtures (a page on the server) are torn down
def pytest_runtest_teardown(item, nextitem):
    """Stop a shared server once no later test of this session asks for it (its fixture's finally is then a no-op)."""
    if not _running:
        return
    later = item.session.items[item.session.items.index(item) + 1:]
    for name in list(_running):
        if not any(name in getattr(i, "fixturenames", ()) for i in later):
            _running.pop(name).close()
