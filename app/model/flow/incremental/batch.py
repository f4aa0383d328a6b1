"""Several streams' incremental hops in one call (cross-stream batching of app/model/flow/incremental/state.py).

Design notes: docs/model.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from app.model.flow.flow import CausalFlow
from app.model.flow.incremental.paged_solve import solve_calls
from app.model.flow.incremental.state import FlowState, prepare_hops


@torch.inference_mode()
def incremental_batch(flow: CausalFlow, states: list[FlowState], tokens: list[Tensor], *,
                      finalize: list[bool], token_offsets: list[int], graphs=None,
                      work=None) -> list[Tensor | ValueError]:
    """`incremental_inference` of B streams (one call each, distinct states), the estimator batched.

    tokens[i]: [1, N_i] stream i's generated prefix; finalize/token_offsets: per stream. Returns per
    stream its fp32 mel [1, 80, T_i], or the ValueError that refused its call (its state unchanged;
    the other streams still run; `PoolFull` when a state found no free blocks in its pool). The states
    (app/model/flow/incremental/paged.py) solve together, packed (`graphs`: a `PagedGraphs` to replay, its
    `encoder` graphs for the encoder pass).
    `work`: a `FlowWork` (app/model/flow/work.py) told each solve's shape.
    """
    assert len({id(s) for s in states}) == len(states), "one call per stream state"
    prepared = prepare_hops(flow, states, tokens, finalize=finalize, token_offsets=token_offsets,
                            graphs=None if graphs is None else graphs.encoder)  # one encoder pass
    hops = [h for h in prepared if not isinstance(h, ValueError)]
    out: list[Tensor | ValueError | None] = [h if isinstance(h, ValueError) else None for h in prepared]
    if not hops:
        return out
    assert len({id(h.state.est.pool) for h in hops}) == 1, "one pool per packed call"
    mels = solve_calls(flow, [h.est_call for h in hops], [h.mu for h in hops], [h.state.spks for h in hops],
                       [h.cond for h in hops], graphs, work)
    done = iter(h.commit(mel) for h, mel in zip(hops, mels, strict=True))
    return [next(done) if o is None else o for o in out]
