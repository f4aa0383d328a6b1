"""The estimator work of the flow calls, counted per call from the model's dims: FLOPs, frames
computed (row and frame padding included) and frames needed, for the bench's per-level lever facts
(achieved TFLOP/s, padding waste). Counting costs a few integer operations per call."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


def flop_rates(estimator) -> tuple[float, float]:
    """(FLOPs per frame per row and evaluation of the estimator's per-frame weights, FLOPs per visible
    (query, key) pair per evaluation of its attention). Per-row weights (the time MLPs) are not per
    frame and left out. CosyVoice2-0.5B: 132.2 MFLOP and 0.1147 MFLOP (56 layers x 4 x 512)."""
    linear = 2 * sum(p.numel() for n, p in estimator.named_parameters()
                     if p.dim() >= 2 and "time_mlp" not in n and ".mlp." not in n)
    d = estimator.dims
    layers = d.n_blocks * (d.num_mid_blocks + 2)
    return float(linear), float(4 * d.num_heads * d.attention_head_dim * layers)


@dataclass
class FlowWork:
    """Totals over every flow call since start (thread-safe; the bench reads differences per level).
    A call of B_pad rows x N_pad frames over K_pad keys each computes 2 (CFG) x evaluations x
    B_pad x N_pad x (linear + K_pad x attention) FLOPs (dense attention: masked keys count, as the
    kernels compute them); `frames_needed` counts only the rows' own frames (the re-solve's whole
    prefix is needed by that path; the incremental path needs only its new frames)."""

    linear_flop: float = 0.0  # per frame per row and evaluation (flop_rates)
    attention_flop: float = 0.0  # per (query, key) pair per evaluation
    evaluations: int = 20  # Euler steps x 2 CFG rows
    calls: int = 0
    frames_computed: int = 0  # rows x frames the estimator ran, padding included
    frames_needed: int = 0
    flop: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def of(cls, flow) -> FlowWork:
        lin, att = flop_rates(flow.decoder["estimator"])
        return cls(linear_flop=lin, attention_flop=att, evaluations=2 * flow.dims.n_timesteps)

    def add(self, rows: int, frames: int, keys: int, needed: int) -> None:
        """One call: `rows` x `frames` computed (padded), each frame over `keys` keys; `needed` frames."""
        flop = self.evaluations * rows * frames * (self.linear_flop + keys * self.attention_flop)
        with self._lock:
            self.calls += 1
            self.frames_computed += rows * frames
            self.frames_needed += needed
            self.flop += flop

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {"calls": self.calls, "frames_computed": self.frames_computed,
                    "frames_needed": self.frames_needed, "tflop": self.flop / 1e12}
