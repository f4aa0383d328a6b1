"""Every numeric bound of the suite, in one place, with where it comes from.

Parity bounds (ours vs the official goldens) are the fixture README's §6 tolerances, verbatim.
Consistency bounds (ours vs ours: batched vs alone, padded vs unpadded, folded weight norm) have no
README entry; each is at least 3x the largest error measured across CPU code paths (`python -m
bench.dispatch_spread`: the default dispatch and MKL/oneDNN/ATen forced down to AVX2, SSE4.2
and baseline on an AVX-512+AMX Xeon; docs/parity.md has the table), and stays orders of magnitude
below any difference the tests must detect.

`within(value, bound)` checks a bound and records the measured value for the spread report
(`COSYVOICE_ERROR_REPORT=path.json python -m pytest ...` writes every test's largest value).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# --- fixture README §6 (fp32 CPU) ------------------------------------------------------------
AUDIO_ATOL = 1e-4  # resampled audio
LOGMEL_ATOL = 1e-4  # whisper log-mel
FBANK_ATOL = 1e-3  # kaldi fbank (and CMN), prompt mel (log domain)
XVECTOR_ATOL = 1e-5  # x-vector given the golden fbank
LM_INPUT_ATOL = 1e-6  # lm_input (pure lookups)
LM_ATOL = 1e-4  # LLM hidden / logits
FLOW_MU_ATOL = 1e-4  # flow mu, estimator output
FLOW_MEL_ATOL = 1e-3  # flow mel
F0_ATOL = 2e-3  # HiFT f0 (Hz)
SOURCE_ATOL = 2e-3  # HiFT source
DECODE_ATOL = 1e-4  # HiFT decode with a provided source
WAVE_MAX_ATOL, WAVE_RMS_ATOL = 5e-2, 5e-3  # HiFT inference / stream chunks / e2e audio
OWN_TOKEN_AGREEMENT = 0.9  # speech tokens from our own features: "case a vs b agree on 90%"

# --- measured spreads (no README entry), see the module docstring ------------------------------
# Max over the six dispatch settings of bench/dispatch_spread.py (docs/parity_dispatch.json).
# x-vector from our own fbank (which itself is up to 6.5e-4 off the golden one): max 1.6e-7, as the
# stand-in CAM++ averages over time; held to the README's x-vector tolerance.
OWN_XVECTOR_ATOL = 1e-5
# Rows of one batched call vs each row alone, frames/rows padded to graph buckets (flow encoder,
# estimator, solve): max 2.5e-6 on values of RMS ~1.3; HiFT wave rows 1.0e-7.
BATCH_ATOL = 1e-5
# HiFT source rows in a batch vs alone: 3.0e-8 on every setting.
SOURCE_BATCH_ATOL = 1e-6
# flow_batch rows vs alone through the whole 10-step solve of 3 mixed-length rows: max 3.3e-6; the
# README's flow mu/estimator tolerance.
BATCH_SOLVE_ATOL = FLOW_MU_ATOL
# HiFT with weight norm folded vs parametrised: 0.0 (wave and source) on every setting.
FOLD_WAVE_ATOL, FOLD_SOURCE_ATOL = 1e-5, 1e-6
# A first chunk cut mid-chunk vs the aligned official call: its frames before the cut chunk agree
# to max 1.4e-6 (MKL AVX2; 0.0 elsewhere); the cut chunk's frames differ by far more than FLOW_MEL_ATOL.
PREFIX_ATOL = 1e-5
# The incremental flow vs the re-solve (tests/test_flow_incremental.py): fp32 max 2.1e-6 (the re-solve's own
# rounding across GEMM/attention shapes), fp64 0.0 (measured on the default dispatch).
INCREMENTAL_ATOL, INCREMENTAL_F64_ATOL = 2e-5, 1e-12
# fp16 flow (the default and fast.toml), incremental hops batched across streams vs alone and vs the fp16 re-solve
# (tests/test_incremental_batch.py): max 7.8e-3, two fp16 steps at the mel's absmax (~4.9); >= 3x that,
# below the fp16 flow's measured deviation from fp32 (max 0.048).
HALF_INCREMENTAL_ATOL = 2.5e-2
# The fixed flow noise drawn by ATen's scalar normal_ kernel (ATEN_CPU_CAPABILITY=default) instead of its
# AVX2/AVX-512 one: 38 % of values differ, by at most 2.3e-6 (measured); exact on the vectorised kernels.
NOISE_ATOL = 1e-5

_measured: dict[str, dict[str, float]] = {}


def _record(what: str, kind: str, value: float, bound: float) -> None:
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    key = f"{test} {what}{' agreement' if kind == 'min' else ''}".replace("  ", " ").rstrip()
    seen = _measured.setdefault(key, {kind: value})
    seen[kind] = (min if kind == "min" else max)(seen[kind], value)
    seen["at_least" if kind == "min" else "bound"] = bound


def within(value: float, bound: float, what: str = "") -> bool:
    """`value <= bound`; records `value` under the running test's id (+ `what`) for the report."""
    _record(what, "max", float(value), bound)
    return float(value) <= bound


def at_least(value: float, bound: float, what: str = "") -> bool:
    """`value >= bound` (agreement rates), recorded like `within` (the smallest value seen)."""
    _record(what, "min", float(value), bound)
    return float(value) >= bound


def write_report(path: str | Path) -> None:
    Path(path).write_text(json.dumps(dict(sorted(_measured.items())), indent=1) + "\n")
