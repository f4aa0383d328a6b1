"""Every numeric bound of the suite under several CPU code paths: the spread behind tests/tolerances.py.

Runs the numeric test files once per dispatch setting (MKL's instruction set, oneDNN's ISA cap,
ATen's kernel capability, all of them down at once), each with COSYVOICE_ERROR_REPORT, and writes
one JSON (per test bound: the measured value per setting, the bound, and whether all passed) plus a
Markdown table. Usage: `python -m bench.dispatch_spread [--out docs/parity_dispatch.json]`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FILES = ["tests/test_features.py", "tests/test_frontend.py", "tests/test_llm.py", "tests/test_flow.py",
         "tests/test_hift.py", "tests/test_token2wav.py", "tests/test_text.py", "tests/test_make_model_parts.py",
         "tests/test_pipeline.py", "tests/test_flow_incremental.py", "tests/test_incremental_pipeline.py",
         "tests/test_config.py"]
SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "MKL AVX2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "MKL SSE4_2": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "oneDNN AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "ATen default": {"ATEN_CPU_CAPABILITY": "default"},
    "all down": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41", "ATEN_CPU_CAPABILITY": "default"},
}
_KEYS = ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


def run(name: str, extra: dict[str, str], workdir: Path) -> tuple[int, dict]:
    report = workdir / f"{name.replace(' ', '_')}.json"
    env = {k: v for k, v in os.environ.items() if k not in _KEYS} | extra | {"COSYVOICE_ERROR_REPORT": str(report)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FILES]
    rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
    return rc, json.loads(report.read_text()) if report.exists() else {}


def table(merged: dict, names: list[str]) -> str:
    """Markdown: one row per test function and bound (parametrised cases merged: worst value)."""
    groups: dict[tuple, dict[str, float]] = {}
    for key, row in merged.items():
        path, test = key.split("::", 1)
        base = re.sub(r"\[.*?\]", "", test)
        g = groups.setdefault((Path(path).stem.removeprefix("test_"), base, row["kind"], row["limit"]), {})
        worst = max if row["kind"] == "max" else min
        for n, v in row["values"].items():
            g[n] = worst(g[n], v) if n in g else v
    lines = ["| test: bound | " + " | ".join(names) + " | limit |", "|---|" + "---|" * (len(names) + 1)]
    for (f, test, kind, limit), g in groups.items():
        cells = [f"{g[n]:.2g}" if n in g else "-" for n in names]
        lines.append(f"| `{f}::{test}` | " + " | ".join(cells) + f" | {'>=' if kind == 'min' else '<='} {limit:.2g} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "out" / "dispatch_spread.json")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names of SETTINGS")
    ap.add_argument("--table-only", action="store_true", help="print the table of an existing --out file")
    args = ap.parse_args()
    if args.table_only:
        out = json.loads(args.out.read_text())
        print(table(out["bounds"], list(out["settings"])))
        return
    names = args.settings.split(",")
    merged: dict[str, dict] = {}
    rcs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            rc, rep = run(name, SETTINGS[name], Path(tmp))
            rcs[name] = rc
            print(f"== {name}: pytest exit {rc}, {len(rep)} bounds", flush=True)
            for key, v in rep.items():
                kind = "min" if "min" in v else "max"
                row = merged.setdefault(key, {"kind": kind, "limit": v.get("bound", v.get("at_least")), "values": {}})
                row["values"][name] = v[kind]
    out = {"settings": {n: SETTINGS[n] for n in names}, "pytest_exit": rcs, "files": FILES,
           "bounds": dict(sorted(merged.items()))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(table(out["bounds"], names))
    print("pytest exit codes:", rcs)
    sys.exit(max(rcs.values()))


if __name__ == "__main__":
    main()
