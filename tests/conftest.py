"""Shared fixtures: the parity fixture set (COSYVOICE_PARITY_DIR) and its golden arrays."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PARITY_DIR = REPO.parent / "shared" / "fixtures" / "parity_v1"


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
