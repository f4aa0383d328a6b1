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
