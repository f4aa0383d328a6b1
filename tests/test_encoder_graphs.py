"""The hops' encoder pass at static shapes (app/model/flow/incremental/encode_batch.py) and its CUDA graphs
(encoder_graphs.py): a pass padded to a bucket (more rows, more new tokens, more keys) gives each stream the
same mu, conv tails and keys/values as its tight pass, and writes nothing outside the streams' new positions but
the sink block; a bucket runs the same ops at the same shapes whichever streams fill it, none reading a device
value on the host (what a CUDA graph needs, checked on the CPU); the bucket chosen is the least work that holds a
call; on a GPU a replay equals the eager pass."""

from __future__ import annotations

import pytest
import torch
from test_encoder_rows import _streams
from tolerances import BATCH_ATOL, within
from torch.utils._python_dispatch import TorchDispatchMode

from app.model.flow import load_flow
from app.model.flow.incremental.encode_batch import encode_rows, encoder_inputs
from app.model.flow.incremental.encoder_graphs import EncoderGraphs
from app.model.flow.incremental.encoder_rows import flat_rows
from app.model.flow.incremental.paged import PAD_BLOCK, SINK_BLOCK, KVPool
from app.model.flow.incremental.state import _checked
from app.model.hparams import load_hparams

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def flow(parity_model_dir):
    return load_flow(parity_model_dir / "flow.pt", load_hparams(parity_model_dir).flow)


def _plans(flow, prompt, tokens, pool, *, cut: int = 0):
    """Three streams' next hop plans; the last stream's hop `cut` tokens shorter (rows of unequal length)."""
    streams, prefix = _streams(flow, prompt, tokens, pool)
    plans = []
    for i, (s, tok) in enumerate(streams):
        p = s.next_plan(tok.shape[1], lm_finished=False)
        n = p.n_tokens - (cut if i == 2 else 0)
        plans.append(_checked(flow, s.flow_state, tok[:, :n], finalize=False, token_offset=p.token_offset))
    return streams, prefix, plans


def _changed(kv, old):
    """[rows]: any byte of any layer's K/V differs (bytes: untouched rows are uninitialised, NaN != NaN)."""
    return (kv.view(torch.uint8) != old.view(torch.uint8)).flatten(3).any(-1).any(0).any(0)


@torch.inference_mode()
def test_a_padded_pass_equals_the_tight_one(flow, prompt, tokens):
    pool = KVPool(flow, n_blocks=96)
    streams, _, plans = _plans(flow, prompt, tokens, pool, cut=7)
    rows, up = pool.encoder, flow.encoder.up_layer.stride
    n = [p.tok_call.end - p.tok_call.start for p in plans]
    assert len(set(n)) > 1, "rows of unequal length"
    before = [kv.clone() for kv in rows.kv]
    tight = encode_rows(flow, rows, encoder_inputs(flow, rows, plans))
    written = [kv.clone() for kv in rows.kv]
    for kv, old in zip(rows.kv, before, strict=True):
        kv.copy_(old)
    N, E = max(n), max(p.tok_call.end for p in plans)
    padded = encode_rows(flow, rows, encoder_inputs(flow, rows, plans, streams=5, tokens=N + 9, keys=E + 40))
    assert padded[0].shape[0] == 5 and padded[0].shape[1] == up * (N + 9)
    for b, nb in enumerate(n):
        within(float((padded[0][b, : up * nb] - tight[0][b, : up * nb]).abs().max()), BATCH_ATOL)
        for t_pad, t_tight in zip(padded[1:], tight[1:], strict=True):
            within(float((t_pad[b] - t_tight[b]).abs().max()), BATCH_ATOL)
    for stage, (kv, old, tight_kv, r) in enumerate(zip(rows.kv, before, written, rows.rows, strict=True)):
        new = torch.zeros(kv.shape[2], dtype=torch.bool)
        for (s, _), p in zip(streams, plans, strict=True):
            call = (p.tok_call, p.frm_call)[stage]
            new[flat_rows(s.flow_state.est.table, r, call.end)[call.start :]] = True
        sink = torch.zeros_like(new)
        sink[SINK_BLOCK * r : (SINK_BLOCK + 1) * r] = True
        changed = _changed(kv, old)
        assert changed[new].all() and not (changed & ~new & ~sink).any(), "a write outside new positions and sink"
        assert not kv[:, :, PAD_BLOCK * r : (PAD_BLOCK + 1) * r].any(), "the pad block was written"
        within(float((kv[:, :, new] - tight_kv[:, :, new]).abs().max()), BATCH_ATOL)
    for s, _ in streams:
        s.flow_state.release()


@torch.inference_mode()
def test_the_bucket_is_the_least_work_that_holds_the_call(flow, prompt, tokens):
    pool = KVPool(flow, n_blocks=96)
    streams, _, plans = _plans(flow, prompt, tokens, pool)
    g = EncoderGraphs(flow, pool, rows=(1, 4, 16), key_blocks=(8, 16))
    per_block = pool.encoder.rows[0]
    assert g.todo[0] == (1, 50, 8 * per_block) and len(g.todo) == 3 * 3 * 2
    assert g.capture() == 0 or torch.cuda.is_available(), "graphs are CUDA only"
    assert g.run(plans) is None and g.misses == 1, "no bucket held: the caller runs the pass eagerly"
    N = max(p.tok_call.end - p.tok_call.start for p in plans)
    E = max(p.tok_call.end for p in plans)
    g._graphs = {k: None for k in g.todo}  # the keys only: which bucket a call takes
    keys = next(k * per_block for k in (8, 16) if k * per_block >= E)
    assert g.bucket(plans) == (4, next(t for t in (50, 100, 125) if t >= N), keys)
    assert g.bucket(plans[:1])[0] == 1
    for s, _ in streams:
        s.flow_state.release()


@pytest.mark.gpu
def test_a_replayed_pass_equals_the_eager_one(parity_model_dir, prompt, tokens):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    flow = load_flow(parity_model_dir / "flow.pt", load_hparams(parity_model_dir).flow).cuda()
    with torch.inference_mode():
        pool = KVPool(flow, n_blocks=96)
        _, _, plans = _plans(flow, prompt, tokens, pool, cut=5)
        g = EncoderGraphs(flow, pool, rows=(4,), key_blocks=(8, 16))
        assert g.capture() == len(g.todo) and g.capture_failures == 0
        before = [kv.clone() for kv in pool.encoder.kv]
        replay = g.run(plans)
        assert replay is not None and g.replays == 1
        for kv, old in zip(pool.encoder.kv, before, strict=True):
            kv.copy_(old)
        key = g.bucket(plans)
        eager = encode_rows(flow, pool.encoder, encoder_inputs(flow, pool.encoder, plans, streams=key[0],
                                                               tokens=key[1], keys=key[2]))
        for b, p in enumerate(plans):
            m = 2 * (p.tok_call.end - p.tok_call.start)
            assert float((replay[0][b, :m] - eager[0][b, :m]).abs().max()) < BATCH_ATOL


class _Trace(TorchDispatchMode):
    """Every aten op of a region with its output shapes; fails on an op that reads a tensor's value on the host
    or whose output shape depends on values (a CUDA graph can capture neither)."""

    SYNCS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "repeat_interleave", "equal")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        assert not any(name.startswith(s) for s in self.SYNCS), f"{name}: a host sync or a value-dependent shape"
        out = func(*args, **(kwargs or {}))
        shapes = [tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out]) if torch.is_tensor(t)]
        self.ops.append((name, shapes))
        return out


@torch.inference_mode()
def test_a_bucket_runs_the_same_ops_whatever_the_streams(flow, prompt, tokens):
    """What a CUDA graph replays: the op sequence and every shape of the pass are those of its capture (padding
    rows only) whichever streams fill the bucket; nothing reads a device value on the host."""
    pool = KVPool(flow, n_blocks=96)
    streams, _, plans = _plans(flow, prompt, tokens, pool, cut=7)
    rows = pool.encoder
    N = max(p.tok_call.end - p.tok_call.start for p in plans) + 3
    E = max(p.tok_call.end for p in plans) + 20
    traces = []
    for members in ([], plans[:1], plans):
        inp = encoder_inputs(flow, rows, members, streams=4, tokens=N, keys=E)
        with _Trace() as t:
            encode_rows(flow, rows, inp)
        traces.append(t.ops)
    assert len(traces[0]) > 100 and traces[0] == traces[1] == traces[2]
    for s, _ in streams:
        s.flow_state.release()
