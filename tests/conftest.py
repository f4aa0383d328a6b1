"""Shared fixtures: the parity fixture set (COSYVOICE_PARITY_DIR) and its golden arrays."""

from __future__ import annotations

import json
import os
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

    from app.model.token2wav import FlowPrompt

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

