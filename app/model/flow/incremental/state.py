"""Incremental streaming flow: each streaming call computes only the frames after the last committed
chunk, from a per-stream `FlowState`, and gives the re-solve's mel (`CausalFlow.inference`).
Design notes: docs/model.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from app.model.flow.flow import CausalFlow
from app.model.flow.incremental.cache import StageCall, StageState
from app.model.flow.incremental.encode_batch import encoder_pass
from app.model.flow.incremental.paged import KVPool, PagedEstCall, PagedStage
from app.model.flow.incremental.paged_solve import solve_calls


def prompt_only_chunks(n_prompt_tokens: int, chunk_tokens: int, lookahead: int) -> int:
    """Chunks whose tokens and look-ahead are all prompt: the largest c with chunk·c + lookahead <= P."""
    return max(0, (n_prompt_tokens - lookahead) // chunk_tokens)


class FlowState:
    """One stream's incremental flow state: the prompt, the committed tokens and, per stage,
    conv left context of the committed positions (app/model/flow/incremental/cache.py); the keys/values of all
    three stages live in its blocks of the pool.

    `n_tokens` prompt + generated tokens are committed (a multiple of the 25-token chunk), i.e.
    `2·n_tokens` mel frames. `prefix`: the shared voice state this one started from (read only).
    `pool`: the `KVPool` (app/model/flow/incremental/paged.py) that keeps every stage's keys/values and the
    estimator's conv tails (a prefix is built on the same pool, and its blocks are shared, not copied);
    `release()` gives them back (call it from the stream's `finally`). Lives on the per-request object,
    never on the shared flow module.
    """

    def __init__(self, flow: CausalFlow, prompt_tokens: Tensor, prompt_mel: Tensor, embedding: Tensor,
                 *, pool: KVPool, prefix: VoicePrefix | None = None) -> None:
        w = next(flow.parameters())
        self.dtype, self.device = w.dtype, w.device
        self.prompt_tokens = prompt_tokens.to(self.device).long()  # [1, P]
        self.prompt_mel = prompt_mel.to(self.device)  # [1, 2P, 80]
        self.embedding = embedding.to(self.device)  # [1, 192]
        with torch.inference_mode():
            self.spks = flow.speaker_embedding(self.embedding)  # [1, 80], flow dtype
        self.prefix = prefix
        self.finished = False
        if prefix is not None:
            if not prefix.matches(self.prompt_tokens, self.prompt_mel, self.embedding):
                raise ValueError("voice prefix was built from another prompt (tokens, mel or x-vector differ)")
            src = prefix.state
            if src.est.pool is not pool:
                raise ValueError("voice prefix and stream state must use the same flow state pool")
            self.enc, self.up, self.est = src.enc.share(), src.up.share(), src.est.share()
            self.prompt_ids = src.prompt_ids
            self.token_ids = src.token_ids  # [1, committed + lookahead] tokens the state depends on (host)
            return
        self.enc, self.up = StageState(), StageState()  # their keys/values: in the estimator stage's blocks
        self.est = PagedStage(pool)
        # the token bookkeeping stays on the host: a hop's plan then never waits for the device
        self.prompt_ids = self.prompt_tokens.cpu()  # [1, P] int64
        self.token_ids = self.prompt_ids[:, :0]

    @property
    def n_tokens(self) -> int:
        return self.enc.length

    @property
    def n_frames(self) -> int:
        return self.est.length

    @property
    def stages(self) -> tuple[StageState, StageState, PagedStage]:
        return self.enc, self.up, self.est

    @property
    def nbytes(self) -> int:
        """Bytes this state holds itself (a prefix it still aliases is not counted)."""
        return sum(s.nbytes for s in self.stages)

    def release(self) -> None:
        """Gives pooled blocks and the tail slot back (idempotent)."""
        self.est.release()


class VoicePrefix:
    """Read-only flow state of a voice's prompt-only chunks (`build_voice_prefix`), shared by streams."""

    def __init__(self, state: FlowState) -> None:
        self.state = state
        self.n_tokens, self.n_frames = state.n_tokens, state.n_frames
        self.nbytes = state.nbytes

    def release(self) -> None:
        """Drops the prefix's own references to its pooled blocks (a prompt cache eviction); streams
        started from it keep theirs until they end."""
        self.state.release()

    def matches(self, prompt_tokens: Tensor, prompt_mel: Tensor, embedding: Tensor) -> bool:
        s = self.state
        return (prompt_tokens.shape == s.prompt_tokens.shape and torch.equal(prompt_tokens, s.prompt_tokens)
                and prompt_mel.shape == s.prompt_mel.shape and torch.equal(prompt_mel, s.prompt_mel)
                and embedding.shape == s.embedding.shape and torch.equal(embedding, s.embedding))


@torch.inference_mode()
def build_voice_prefix(flow: CausalFlow, prompt_tokens: Tensor, prompt_mel: Tensor,
                       embedding: Tensor, pool: KVPool) -> VoicePrefix:
    """State of the prompt-only chunks of a voice (prompt_tokens [1, P], prompt_mel [1, 2P, 80],
    embedding [1, 192]); zero chunks (a short prompt) gives an empty prefix. Its estimator blocks live
    in `pool`, shared by reference with the streams started from it."""
    state = FlowState(flow, prompt_tokens, prompt_mel, embedding, pool=pool)
    chunk, n_ctx = flow.dims.encoder.static_chunk_size, flow.dims.pre_lookahead_len
    n = prompt_only_chunks(state.prompt_tokens.shape[1], chunk, n_ctx) * chunk
    if n:
        _advance(flow, state, state.prompt_ids[:, : n + n_ctx], finalize=False)
    state.enc, state.up, state.est = (s.trimmed() for s in state.stages)
    return VoicePrefix(state)


@torch.inference_mode()
def incremental_inference(flow: CausalFlow, state: FlowState, token: Tensor, *, finalize: bool = False,
                          token_offset: int = 0) -> Tensor:
    """`flow.inference(token, ..., streaming=True, finalize)[:, :, 2·token_offset:]` from `state`.

    token: [1, N] the whole generated prefix so far (it must extend the tokens of earlier calls);
    finalize: last call (no look-ahead held back); afterwards the state is finished.
    Computes frames from the committed edge on and commits the call's whole chunks.
    Returns fp32 mel [1, 80, 2(N - 3·(not finalize) - token_offset)].
    """
    return _solved(flow, prepare_hop(flow, state, token, finalize=finalize, token_offset=token_offset))


class Hop:
    """One stream's incremental call after its encoder pass, before the estimator solve (`prepare_hop`).

    mu, cond: [1, 80, n] of the call's new frames; est_call: the estimator stage's `PagedEstCall`.
    `commit(mel)` commits the call's whole chunks and returns the frames asked for.
    """

    def __init__(self, state: FlowState, calls: tuple[StageCall, StageCall, PagedEstCall], mu: Tensor,
                 cond: Tensor, tokens: Tensor, n_keep: int, first: int, finalize: bool) -> None:
        self.state, self.calls, self.mu, self.cond = state, calls, mu, cond
        self.est_call = calls[2]
        self._tokens, self._n_keep, self._first, self._finalize = tokens, n_keep, first, finalize

    def commit(self, mel: Tensor) -> Tensor:
        """mel: fp32 [1, 80, n] of the new frames -> the frames from the asked offset on (commits)."""
        for call in self.calls:
            call.finish()
        self.state.token_ids = self._tokens[:, : self._n_keep].clone()
        self.state.finished = self._finalize
        return mel[:, :, self._first - self.est_call.start:]


def prepare_hop(flow: CausalFlow, state: FlowState, token: Tensor, *, finalize: bool,
                token_offset: int) -> Hop:
    """Checks one call (arguments as `incremental_inference`) and runs its encoder on the new tokens;
    the state changes only in `Hop.commit` (a refused call raises ValueError and leaves it as it was)."""
    return _encoded(flow, _checked(flow, state, token, finalize=finalize, token_offset=token_offset))


def prepare_hops(flow: CausalFlow, states: list[FlowState], tokens: list[Tensor], *, finalize: list[bool],
                 token_offsets: list[int], graphs=None) -> list[Hop | ValueError]:
    """`prepare_hop` of B streams (distinct states) with one encoder pass for all of them (`graphs`: an
    `EncoderGraphs` replays it where a bucket fits); a refused call is its ValueError in the list (its state
    unchanged), the others still run."""
    def refused(call: Callable[[], Any]) -> Any:  # a stream's ValueError (bad call, full pool) is its result
        try:
            return call()
        except ValueError as e:
            return e

    plans = [refused(partial(_checked, flow, st, tok, finalize=fin, token_offset=off))
             for st, tok, fin, off in zip(states, tokens, finalize, token_offsets, strict=True)]
    ok = [p for p in plans if isinstance(p, _Plan)]
    if not ok:
        return plans
    mus = iter(encoder_pass(flow, ok, graphs))
    return [refused(partial(_hop, flow, p, next(mus))) if isinstance(p, _Plan) else p for p in plans]


def _checked(flow: CausalFlow, state: FlowState, token: Tensor, *, finalize: bool, token_offset: int) -> _Plan:
    if state.finished:
        raise ValueError("this flow state already ran its final call")
    n_prompt = state.prompt_ids.shape[1]
    tokens = torch.cat([state.prompt_ids, token.cpu().long()], dim=1)  # host (a CPU tensor: no copy)
    end = tokens.shape[1] - (0 if finalize else flow.dims.pre_lookahead_len)
    if state.prompt_mel.shape[1] > 2 * end:
        raise ValueError(f"prompt mel has {state.prompt_mel.shape[1]} frames but the tokens give only {2 * end}")
    first = 2 * (n_prompt + token_offset)  # first frame to return
    if first < state.n_frames:
        raise ValueError(f"token_offset {token_offset} is before the committed edge "
                         f"({state.n_tokens - n_prompt} generated tokens): those frames are not recomputed")
    return _plan(flow, state, tokens, finalize=finalize, first=first)


def _advance(flow: CausalFlow, state: FlowState, tokens: Tensor, *, finalize: bool) -> tuple[Tensor, int]:
    """Frames from the committed edge to the end of a streaming call on `tokens` [1, L] (prompt +
    generated, host); commits whole chunks. Returns (fp32 mel [1, 80, n], its first absolute frame)."""
    hop = _encoded(flow, _plan(flow, state, tokens, finalize=finalize, first=None))
    return _solved(flow, hop), hop.est_call.start


@dataclass
class _Plan:
    """One stream's call before its encoder pass: its stage calls and its new token ids (host)."""

    state: FlowState
    tokens: Tensor  # [1, L] prompt + generated, host
    finalize: bool
    first: int | None  # the first frame the caller wants back (None: all new frames)
    commit: int  # tokens committed after the call
    tok_call: StageCall
    frm_call: StageCall
    ids: Tensor  # host int64 [end - start (+ lookahead)]: the tokens this call encodes, then (not at the end of
    # the utterance) the look-ahead tokens after them


def _plan(flow: CausalFlow, state: FlowState, tokens: Tensor, *, finalize: bool, first: int | None) -> _Plan:
    """The stage calls of a streaming call on `tokens` [1, L] (prompt + generated, host) from the committed edge,
    and its new token ids; `first`: the first frame the caller wants back (None: all new frames)."""
    dims = flow.dims
    n_ctx, chunk = dims.pre_lookahead_len, dims.encoder.static_chunk_size
    L = tokens.shape[1]
    end = L if finalize else L - n_ctx  # tokens encoded by this call
    start = state.n_tokens
    if end < start:
        raise ValueError(f"{L} tokens end before the {start} committed ones (+{n_ctx} look-ahead)")
    seen = state.token_ids.shape[1]
    if not torch.equal(tokens[:, :seen], state.token_ids):
        raise ValueError("tokens do not extend the ones this state was computed from")
    commit = end if finalize else end // chunk * chunk
    commit = max(commit, start)

    up = flow.encoder.up_layer.stride
    state.est.reserve(up * end)  # the call's blocks, for all three stages (`PoolFull` before any work)
    rows, blocks = state.est.pool.encoder, state.est.table
    tok_call = StageCall(state.enc, start, end, commit, rows.call_rows(0, blocks, end))
    frm_call = StageCall(state.up, up * start, up * end, up * commit, rows.call_rows(1, blocks, up * end))
    return _Plan(state, tokens, finalize, first, commit, tok_call, frm_call, tokens[0, start:].clamp(min=0))


def _encoded(flow: CausalFlow, p: _Plan) -> Hop:
    """One stream's own encoder pass (no padding)."""
    return _hop(flow, p, encoder_pass(flow, [p])[0])


def _hop(flow: CausalFlow, p: _Plan, mu: Tensor) -> Hop:
    """The `Hop` of a planned call from its encoder pass's mu [1, 80, 2n]."""
    state, dims = p.state, flow.dims
    up = flow.encoder.up_layer.stride
    f0, f1 = p.frm_call.start, p.frm_call.end  # frames of this call
    cond = torch.zeros_like(mu)
    n_prompt_frames = state.prompt_mel.shape[1]
    m = min(f1, n_prompt_frames) - f0  # prompt frames in this call
    if m > 0:
        cond[:, :, :m] = state.prompt_mel[:, f0 : f0 + m].transpose(1, 2).to(mu.dtype)
    chunk = dims.estimator.static_chunk_size
    assert (up * p.commit) % chunk == 0 or p.finalize, "encoder and estimator chunks disagree"
    est_call = PagedEstCall(state.est, f0, f1, up * p.commit)
    return Hop(state, (p.tok_call, p.frm_call, est_call), mu, cond, p.tokens, p.commit + dims.pre_lookahead_len,
               f0 if p.first is None else p.first, p.finalize)


def _solved(flow: CausalFlow, hop: Hop) -> Tensor:
    """`CausalFlow._solve` on one hop's new frames (its packed solve alone), committed -> fp32 [1, 80, n]."""
    return hop.commit(solve_calls(flow, [hop.est_call], [hop.mu], [hop.state.spks], [hop.cond])[0])
