"""The example voices of assets/examples.json, as every bench reads them (stdlib only: the soak and flood
clients run where the app's packages are not installed)."""

from __future__ import annotations

import json
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def example_voices() -> list[dict[str, str | Path]]:
    """[{"name", "audio" (an absolute Path), "transcript"}] in the file's order; the first is the default."""
    voices = json.loads((ASSETS / "examples.json").read_text(encoding="utf-8"))["voices"]
    return [{"name": v["name"], "audio": ASSETS / v["audio"], "transcript": v["transcript"]} for v in voices]
