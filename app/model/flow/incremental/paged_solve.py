"""The paged incremental hops' solve (app/model/flow/incremental/packed.py), replayed by a captured bucket when one
fits (app/model/flow/incremental/paged_graphs.py), else at the call's tight shape."""

from __future__ import annotations

from torch import Tensor

from app.model.flow.flow import CausalFlow
from app.model.flow.incremental.packed import pack, packed_solve, visible_pairs
from app.model.flow.incremental.paged import PagedEstCall


def solve_calls(flow: CausalFlow, calls: list[PagedEstCall], mus: list[Tensor], spks: list[Tensor],
                conds: list[Tensor], graphs=None, work=None) -> list[Tensor]:
    """The estimator solve of S paged streams' hops in one packed call: mus, conds [1, 80, n_i], spks
    [1, 80] -> fp32 [1, 80, n_i] each. `graphs`: a `PagedGraphs` replays a captured bucket when one
    fits. `work`: a `FlowWork` (app/model/flow/work.py) told the frames computed (padding included)
    and the visible (query, key) pairs."""
    pool, e = calls[0].state.pool, flow.dims.estimator
    n = [c.end - c.start for c in calls]
    x = graphs.run(calls, mus, conds, spks) if graphs is not None else None
    if x is None:
        x = packed_solve(flow, pool, pack(flow, pool, calls, mus, conds, spks))
    if work is not None:  # one row of M frames; attention by its visible pairs
        pairs = visible_pairs(calls, e.static_chunk_size, e.num_decoding_left_chunks)
        work.add(1, x.shape[2], pairs / x.shape[2], sum(n))
    return list(x[:, :, : sum(n)].float().split(n, dim=2))  # one cast for all streams
