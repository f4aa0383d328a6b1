"""A small Qwen2 decoder over `inputs_embeds` (gpt-fast style), with a per-request KV cache.

Design notes: docs/model.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from app.model.hparams import QwenDims


class KVCache:
    """Keys/values of one request: per layer `[B, H_kv, S, Dh]`, grown by concatenation.

    `seq_len` is the number of positions already processed, i.e. the RoPE position of the next
    input. A request creates one, passes it to every forward call and drops it when done.
    """

    def __init__(self, n_layers: int) -> None:
        self.keys: list[Tensor | None] = [None] * n_layers
        self.values: list[Tensor | None] = [None] * n_layers
        self.seq_len = 0

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append `k, v [B, H_kv, T, Dh]` for `layer`; return all keys/values so far."""
        old_k, old_v = self.keys[layer], self.values[layer]
        if old_k is not None and old_v is not None:
            k, v = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin tables `[T, Dh]` for integer `positions [T]` (HF rotate-half layout, fp32 math)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, Dh/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, Dh]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [B, H, T, Dh]; cos/sin: [T, Dh] broadcast over B and H
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, d: QwenDims) -> None:
        super().__init__()
        if d.num_heads % d.num_kv_heads:
            raise ValueError(f"num_heads {d.num_heads} is not a multiple of num_kv_heads {d.num_kv_heads}")
        self.n_heads, self.n_kv_heads, self.head_dim = d.num_heads, d.num_kv_heads, d.head_dim
        self.q_proj = nn.Linear(d.hidden_size, d.num_heads * d.head_dim, bias=True)
        self.k_proj = nn.Linear(d.hidden_size, d.num_kv_heads * d.head_dim, bias=True)
        self.v_proj = nn.Linear(d.hidden_size, d.num_kv_heads * d.head_dim, bias=True)
        self.o_proj = nn.Linear(d.num_heads * d.head_dim, d.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                cache: KVCache | None, layer: int) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, Dh]
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, Dh]
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # [B, Hkv, S, Dh], S = past + T
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [B, H, S, Dh]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, T, Dh]
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, d: QwenDims) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d.hidden_size, d.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d.hidden_size, d.intermediate_size, bias=False)
        self.down_proj = nn.Linear(d.intermediate_size, d.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, d: QwenDims) -> None:
        super().__init__()
        self.self_attn = Attention(d)
        self.mlp = MLP(d)
        self.input_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                cache: KVCache | None, layer: int) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen2Model(nn.Module):
    """Embedding table + decoder layers + final norm (HF `Qwen2Model` names)."""

    def __init__(self, d: QwenDims) -> None:
        super().__init__()
        self.dims = d
        self.embed_tokens = nn.Embedding(d.vocab_size, d.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(d) for _ in range(d.num_layers))
        self.norm = RMSNorm(d.hidden_size, d.rms_norm_eps)

    def new_cache(self) -> KVCache:
        return KVCache(len(self.layers))

    def forward(self, inputs_embeds: Tensor, cache: KVCache | None = None) -> Tensor:
        """Causal forward of `inputs_embeds [B, T, D]` after the `cache.seq_len` cached positions.

        Returns the final-norm hidden states `[B, T, D]`. Without a cache the chunk starts at
        position 0; with one, its keys/values are appended and `cache.seq_len` advances by T.
        """
        t = inputs_embeds.shape[1]
        past = cache.seq_len if cache is not None else 0
        device = inputs_embeds.device
        positions = torch.arange(past, past + t, device=device)  # RoPE positions; 0 at sos
        cos, sin = rope_cos_sin(positions, self.dims.head_dim, self.dims.rope_theta, inputs_embeds.dtype)
        mask = None  # one query sees every cached key
        if t > 1:  # query i (position past+i) sees keys 0..past+i
            mask = torch.arange(past + t, device=device)[None, :] <= positions[:, None]  # [T, S] bool
        h = inputs_embeds
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, mask, cache, i)
        if cache is not None:
            cache.seq_len = past + t
        return self.norm(h)


class Qwen2ForCausalLM(nn.Module):
    """`model` + text `lm_head`; the head is unused by the speech LM but present in `llm.pt`.

    `llm.pt` stores `lm_head.weight` sharing storage with `embed_tokens.weight` (tied in
    CosyVoice-BlankEN). Both are kept as parameters so a strict load works; load with
    `load_state_dict(..., assign=True)` to keep the file's sharing instead of a second copy.
    """

    def __init__(self, d: QwenDims) -> None:
        super().__init__()
        self.model = Qwen2Model(d)
        self.lm_head = nn.Linear(d.hidden_size, d.vocab_size, bias=False)

    def forward(self, inputs_embeds: Tensor, cache: KVCache | None = None) -> Tensor:
        return self.model(inputs_embeds, cache)
