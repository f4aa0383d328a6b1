"""`CausalFlow`: speech tokens + prompt (tokens, mel, x-vector) -> 80-bin mel at 50 Hz.

Design notes: docs/model.md.
"""

from __future__ import annotations

import functools
import math
import pickle
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from app.model.flow.encoder import UpsampleConformerEncoder, pad_mask
from app.model.flow.estimator import CausalConditionalDecoder
from app.model.flow.graphs import EstimatorGraphs
from app.model.hparams import FlowDims, ModelFolderError

NOISE_SEED = 0
MAX_MEL_FRAMES = 15_000  # length of the fixed noise: 300 s of prompt + generated mel at 50 Hz


@functools.cache
def fixed_noise() -> torch.Tensor:
    """The official fixed flow noise [1, 80, 15000] = `torch.manual_seed(0); torch.randn(1, 80, 15000)`,
    drawn from a private generator (the global RNG is untouched). Built on first use, shared."""
    gen = torch.Generator(device="cpu").manual_seed(NOISE_SEED)
    return torch.randn(1, 80, MAX_MEL_FRAMES, generator=gen, dtype=torch.float32)


def cosine_time_grid(n_steps: int, dtype: torch.dtype = torch.float32,
                     device: torch.device | None = None) -> torch.Tensor:
    """[n_steps + 1] times t_k = 1 - cos(k/n · π/2), k = 0..n (denser near t = 0)."""
    t = torch.linspace(0, 1, n_steps + 1, dtype=dtype, device=device)
    return 1 - torch.cos(t * 0.5 * math.pi)


class CausalFlow(nn.Module):
    """Token-to-mel flow of CosyVoice2; parameter names match the official `flow.pt`.

    Entry points: `inference` (one request, B=1), and its stages for tests and a batching engine:
    `speaker_embedding`, `encode` (encoder output h), `encoder_proj` (mu), `solve` (CFM ODE on B
    rows) and `estimator` (one velocity evaluation on an already CFG-paired batch).
    """

    def __init__(self, dims: FlowDims):
        super().__init__()
        if dims.t_scheduler != "cosine":
            raise ValueError(f"flow t_scheduler {dims.t_scheduler!r}: only 'cosine' (CosyVoice2) is implemented")
        self.dims = dims
        D = dims.encoder.output_size
        self.input_embedding = nn.Embedding(dims.vocab_size, dims.input_size)
        self.spk_embed_affine_layer = nn.Linear(dims.spk_embed_dim, dims.spk_emb_dim)
        self.encoder = UpsampleConformerEncoder(dims.encoder, dims.pre_lookahead_len)
        self.encoder_proj = nn.Linear(D, dims.output_size)
        self.decoder = nn.ModuleDict({"estimator": CausalConditionalDecoder(dims.estimator)})
        self._noise: torch.Tensor | None = None  # fixed_noise() on the device last used

    # --- stages ---------------------------------------------------------------------------

    def speaker_embedding(self, embedding: torch.Tensor) -> torch.Tensor:
        """x-vector [B, 192] -> spks [B, 80]."""
        w = self.spk_embed_affine_layer.weight
        return self.spk_embed_affine_layer(F.normalize(embedding.to(w.dtype), dim=1))

    def encode(self, tokens: torch.Tensor, lengths: torch.Tensor, *, streaming: bool,
               finalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt+new tokens [B, L] (valid `lengths` [B]) -> (h [B, T, D], frame lengths [B]).

        finalize=False holds back each row's last `pre_lookahead_len` tokens as look-ahead context
        (they are not encoded): T = 2·(L - 3). finalize=True encodes all L tokens: T = 2·L.
        """
        x = self.input_embedding(tokens.clamp(min=0))  # [B, L, D_in]
        x = x * pad_mask(lengths, tokens.shape[1]).transpose(1, 2)
        if finalize:
            return self.encoder(x, lengths, streaming=streaming)
        n_ctx = self.dims.pre_lookahead_len
        lengths = lengths - n_ctx
        if int(lengths.min()) < 0:
            raise ValueError(f"finalize=False needs at least {n_ctx} tokens per row (look-ahead context)")
        idx = lengths[:, None] + torch.arange(n_ctx, device=x.device)  # [B, n_ctx]
        context = x.gather(1, idx[..., None].expand(-1, -1, x.shape[2]))
        return self.encoder(x[:, : int(lengths.max())], lengths, context, streaming=streaming)

    def estimator(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                  spks: torch.Tensor, cond: torch.Tensor, streaming: bool) -> torch.Tensor:
        """One velocity evaluation; shapes as in `CausalConditionalDecoder.forward`."""
        return self.decoder["estimator"](x, mask, mu, t, spks, cond, streaming=streaming)

    def noise(self, n_frames: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The first `n_frames` frames of the fixed noise -> [1, 80, n_frames]."""
        if n_frames > MAX_MEL_FRAMES:
            raise ValueError(f"{n_frames} mel frames (prompt + generated) exceed the flow's "
                             f"{MAX_MEL_FRAMES}-frame limit (300 s); split the text or shorten the prompt")
        if self._noise is None or self._noise.device != device:
            self._noise = fixed_noise().to(device)
        return self._noise[:, :, :n_frames].to(dtype)

    @torch.inference_mode()
    def solve(self, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
              streaming: bool, graphs: EstimatorGraphs | None = None) -> torch.Tensor:
        """Integrate the CFM ODE from the fixed noise with CFG; B independent rows.

        mu, cond: [B, 80, T]; mask: [B, 1, T]; spks: [B, 80]. Every row starts from the same noise
        frames 0..T-1. Each Euler step evaluates the estimator on 2B rows (B conditional, then B
        with mu/spks/cond zeroed) and mixes v = (1+w)·v_cond - w·v_uncond, w = inference_cfg_rate.
        With `graphs` the frames are right-padded to its bucket, the rows to its row bucket (copies of
        the last row), and each evaluation is a graph replay (app/model/flow/graphs.py).
        Returns x(t=1) [B, 80, T] in fp32 (prompt frames included).
        """
        if graphs is None:
            return self._solve(mu, mask, spks, cond, streaming, self.estimator)
        B, _, T = mu.shape
        pad = graphs.padded_length(T) - T  # masked frames after the valid ones
        if pad:
            mu, mask, cond = (F.pad(a, (0, pad)) for a in (mu, mask, cond))
        extra = graphs.padded_rows(B) - B  # copies of the last row (rows never mix), dropped after
        if extra:
            mu, mask, spks, cond = (torch.cat([a, a[-1:].expand(extra, *a.shape[1:])]) for a in (mu, mask, spks, cond))
        with graphs.lock:
            x = self._solve(mu, mask, spks, cond, streaming, graphs)[:B, :, :T]
            graphs.synchronize(x)
        return x

    def _solve(self, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
               streaming: bool, estimator) -> torch.Tensor:
        B, _, T = mu.shape
        w = self.dims.inference_cfg_rate
        x = self.noise(T, mu.device, mu.dtype).expand(B, -1, -1)
        t_grid = cosine_time_grid(self.dims.n_timesteps, mu.dtype, mu.device)
        mask2 = torch.cat([mask, mask]).to(mu.dtype)
        mu2, spks2, cond2 = (torch.cat([a, torch.zeros_like(a)]) for a in (mu, spks, cond))
        # t advances by accumulating dt like the reference (t + dt, next dt = t_grid[k+1] - t)
        t, dt = t_grid[0:1], t_grid[1] - t_grid[0]
        for step in range(1, len(t_grid)):
            v = estimator(torch.cat([x, x]), mask2, mu2, t.expand(2 * B), spks2, cond2, streaming)
            v_cond, v_uncond = v.split(B)
            x = x + dt * ((1.0 + w) * v_cond - w * v_uncond)
            t = t + dt
            if step < len(t_grid) - 1:
                dt = t_grid[step + 1] - t
        return x.float()

    # --- one request ----------------------------------------------------------------------

    @torch.inference_mode()
    def inference(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, *, streaming: bool, finalize: bool,
                  graphs: EstimatorGraphs | None = None) -> torch.Tensor:
        """Mel for the new tokens of one request.

        token: [1, N] speech tokens (the whole prefix generated so far); prompt_token: [1, P];
        prompt_feat: [1, 2P, 80] prompt mel; embedding: [1, 192] x-vector.
        streaming: chunk-causal masks (intermediate chunks); finalize: last call of the request
        (False holds back the last `pre_lookahead_len` tokens as look-ahead only); graphs: see `solve`.
        Returns the fp32 mel after the prompt frames: [1, 80, 2N] (finalize) or [1, 80, 2(N-3)].
        """
        if token.shape[0] != 1 or prompt_token.shape[0] != 1:
            raise ValueError("CausalFlow.inference takes one request (batch 1); use encode/solve for batches")
        spks = self.speaker_embedding(embedding)
        tokens = torch.cat([prompt_token, token], dim=1).long()
        lengths = torch.tensor([tokens.shape[1]], device=tokens.device)
        h, _ = self.encode(tokens, lengths, streaming=streaming, finalize=finalize)
        mu = self.encoder_proj(h).transpose(1, 2)  # [1, 80, T]
        n_prompt, T = prompt_feat.shape[1], mu.shape[2]
        if n_prompt > T:
            raise ValueError(f"prompt mel has {n_prompt} frames but the tokens give only {T}")
        cond = torch.zeros_like(mu)
        cond[:, :, :n_prompt] = prompt_feat.transpose(1, 2).to(mu.dtype)
        mask = torch.ones(1, 1, T, device=mu.device, dtype=mu.dtype)
        return self.solve(mu, mask, spks, cond, streaming, graphs)[:, :, n_prompt:]


def load_flow(path: str | Path, dims: FlowDims, device: str | torch.device = "cpu") -> CausalFlow:
    """Build a `CausalFlow` and strictly load the official `flow.pt` (weights_only) into it, in eval mode."""
    path = Path(path)
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except (OSError, RuntimeError, pickle.UnpicklingError) as e:
        raise ModelFolderError(f"cannot read {path}: {e}") from e
    with torch.device("meta"):
        flow = CausalFlow(dims)
    try:
        flow.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ModelFolderError(f"{path} does not match the sizes in cosyvoice2.yaml: {e}") from e
    return flow.eval()
