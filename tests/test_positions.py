"""The incremental encoder's shared relative-position tables (app/model/flow/incremental/positions.py): a
call's rows are the layer's `linear_pos` of its offsets, their bytes never depend on which call (or thread)
grew the table, rows a call holds survive a growth, and every stream of a pool reads the same table."""

from __future__ import annotations

import threading

import pytest
import torch

from app.model.flow import load_flow
from app.model.flow.encoder import position_rows
from app.model.flow.incremental.paged import KVPool
from app.model.flow.incremental.positions import BLOCK, stage_tables
from app.model.flow.incremental.state import FlowState, incremental_inference
from app.model.hparams import load_hparams

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def flow(parity_model_dir):
    return load_flow(parity_model_dir / "flow.pt", load_hparams(parity_model_dir).flow)


def reference(attn, n: int, end: int) -> torch.Tensor:
    """The rows a layer reads for n new positions over `end` keys, computed for this call alone."""
    w = attn.linear_pos.weight
    rows = position_rows(torch.arange(-(n - 1), end), w.shape[1], w.dtype)
    return attn.linear_pos(rows).view(-1, attn.n_heads, attn.d_head).transpose(0, 1)[None]


@torch.inference_mode()
def test_rows_are_each_layers_linear_pos_of_the_offsets(flow):
    tables = stage_tables(flow.encoder)
    for table, blocks in zip(tables, (flow.encoder.encoders, flow.encoder.up_encoders), strict=True):
        for n, end in ((1, 1), (25, 75), (BLOCK + 3, 3 * BLOCK + 1)):
            for layer, block in enumerate(blocks):
                got, want = table.rows(layer, n, end), reference(block.self_attn, n, end)
                assert got.shape == want.shape == (1, block.self_attn.n_heads, n - 1 + end, block.self_attn.d_head)
                # the same float32 GEMM over another row count: rounding only
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@torch.inference_mode()
def test_bytes_do_not_depend_on_growth_order_or_threads(flow):
    n, end = 2 * BLOCK + 7, 5 * BLOCK - 1
    direct = stage_tables(flow.encoder)[1]
    want = [direct.rows(layer, n, end).clone() for layer in range(len(direct.layers))]

    stepwise = stage_tables(flow.encoder)[1]
    held = stepwise.rows(0, 1, 10)
    before = held.clone()
    for k in range(1, 6):  # grown call by call, as a stream's hops grow it
        stepwise.rows(0, k * n // 5, k * end // 5)
    assert torch.equal(held, before), "a growth changed rows a call already held"

    threaded = stage_tables(flow.encoder)[1]
    sizes = [(1 + 37 * i % n, 1 + 101 * i % end) for i in range(24)] + [(n, end)]
    workers = [threading.Thread(target=threaded.rows, args=(i % len(threaded.layers), a, b))
               for i, (a, b) in enumerate(sizes)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    for layer, w in enumerate(want):
        assert torch.equal(stepwise.rows(layer, n, end), w)
        assert torch.equal(threaded.rows(layer, n, end), w)
    # whole blocks on both sides: offsets -(2·BLOCK + 6) .. 5·BLOCK - 2 need 3 blocks before 0 and 5 from it
    assert direct.nbytes == threaded.nbytes == direct.layers[0].weight.element_size() * len(direct.layers) \
        * direct.heads * direct.d_head * 8 * BLOCK


def test_streams_of_one_pool_read_one_table_and_hold_none(flow, prompt, tokens):
    pool = KVPool(flow, n_blocks=96)
    states = [FlowState(flow, prompt.tokens, prompt.mel, prompt.embedding, pool=pool) for _ in range(2)]
    tok_table, frm_table = pool.encoder.positions
    mels, sizes = [], []
    for state in states:
        mels.append(incremental_inference(flow, state, tokens[:, :40]))
        sizes.append((tok_table.nbytes, frm_table.nbytes))
    assert min(sizes[0]) > 0 and sizes[1] == sizes[0], "the second stream's call grew no position rows"
    assert torch.equal(mels[0], mels[1]), "the second stream read the rows the first one grew, bytes unchanged"
    for state in states:
        state.release()
