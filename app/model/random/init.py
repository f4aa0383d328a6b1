"""Seeded random weights for our CosyVoice2 modules, so every tensor matters.

Design notes: docs/model.md.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from app.audio import OUTPUT_SAMPLE_RATE_HZ
from app.model.features import prompt_mel
from app.model.hparams import FeatDims
from app.model.llm import EOS_TOKEN

_EMBEDDINGS = ("embed_tokens.weight", "speech_embedding.weight", "llm_embedding.weight", "input_embedding.weight")


def _fill(name: str, t: Tensor, g: torch.Generator, hidden: int) -> None:
    def normal(std: float) -> None:
        t.copy_(torch.randn(t.shape, generator=g) * std)

    def uniform(lo: float, hi: float) -> None:
        t.copy_(lo + (hi - lo) * torch.rand(t.shape, generator=g))

    if name.endswith(_EMBEDDINGS):
        normal(1.0)
    elif name.startswith("llm_decoder.") and name.endswith("weight"):
        normal(2.0 / math.sqrt(hidden))
    elif name.endswith(("pos_bias_u", "pos_bias_v")):
        normal(0.3)
    elif name.endswith("alpha") or ".alpha" in name:
        uniform(0.5, 1.5)
    elif name.endswith("bias"):
        normal(0.2 if any(k in name for k in ("q_proj", "k_proj", "v_proj")) else 0.05)
    elif t.dim() >= 2:
        normal(1.0 / math.sqrt(t[0].numel()))
    else:  # 1-D weights: LayerNorm / RMSNorm gains
        uniform(0.7, 1.3)


@torch.no_grad()
def randomize(module: nn.Module, g: torch.Generator, hidden: int = 1) -> None:
    """Re-draw every parameter of `module` in place (weight-norm g set from its v)."""
    params = dict(module.named_parameters())
    for name, p in params.items():
        if not name.endswith("original0"):
            _fill(name, p.data, g, hidden)
    for name, p in params.items():
        if name.endswith("original0"):  # g of weight norm: per-channel norm of v, jittered
            v = params[name[: -len("0")] + "1"].data
            norm = v.flatten(1).norm(dim=1).reshape(p.shape)
            p.data.copy_(norm * (0.8 + 0.4 * torch.rand(p.shape, generator=g)))


def calibration_mel(feat: FeatDims, seconds: float = 3.0) -> Tensor:
    """[1, 80, T] log-mel of a synthetic voiced signal (harmonics of a gliding 100-180 Hz f0)."""
    n = int(seconds * OUTPUT_SAMPLE_RATE_HZ)
    t = torch.arange(n, dtype=torch.float64) / OUTPUT_SAMPLE_RATE_HZ
    f0 = 140 + 40 * torch.sin(2 * math.pi * 0.7 * t)
    phase = 2 * math.pi * torch.cumsum(f0, 0) / OUTPUT_SAMPLE_RATE_HZ
    wave = sum(torch.sin(k * phase) / k for k in range(1, 20)) * 0.1
    wave = wave * (0.6 + 0.4 * torch.sin(2 * math.pi * 2.5 * t).abs())  # syllable-like envelope
    return prompt_mel(wave.float()[None], feat).transpose(1, 2)


@torch.no_grad()
def calibrate_hift(hift: nn.Module, mel: Tensor, target_std: float = 0.05) -> None:
    """Rescale the f0 head to 60 + 80 z Hz and the magnitude bias to a waveform std near target."""
    f0_head = hift.f0_predictor.classifier
    feats = {}
    hook = f0_head.register_forward_hook(lambda m, i, o: feats.__setitem__("x", i[0]))
    hift.f0(mel)
    hook.remove()
    raw = f0_head(feats["x"]).flatten()
    mu, sd = raw.mean(), raw.std().clamp_min(1e-6)
    scale = 80.0 / sd
    f0_head.weight.mul_(scale)
    f0_head.bias.copy_((f0_head.bias - mu) * scale + 60.0)
    n_mag = hift.conv_post.bias.shape[0] // 2  # channels 0..n_fft/2 are log-magnitudes
    for _ in range(4):
        wav, _src = hift.inference(mel, None)
        std = wav.std().clamp_min(1e-8)
        hift.conv_post.bias[:n_mag] += torch.log(target_std / std)


@torch.no_grad()
def calibrate_eos(llm: nn.Module, g: torch.Generator, mean_tokens: float = 60.0, steps: int = 48) -> None:
    """Set the eos bias so an average step ends the utterance with probability ~1/mean_tokens."""
    eos = EOS_TOKEN
    d = llm.llm_embedding.weight.shape[1]
    prefix = torch.randn(1, 12, d, generator=g)
    forced = torch.randint(0, eos, (1, steps), generator=g)
    x = torch.cat([prefix, llm.speech_embedding(forced)], dim=1)
    logits = llm.llm_decoder(llm.hidden(x))[0, prefix.shape[1] - 1:]  # [steps+1, V]
    others = torch.logsumexp(torch.cat([logits[:, :eos], logits[:, eos + 1:]], dim=1), dim=1)
    # p(eos) = 1 / mean_tokens  <=>  logit_eos = others + log(1 / (mean_tokens - 1))
    want = others - math.log(mean_tokens - 1)
    llm.llm_decoder.bias[eos] += (want - logits[:, eos]).mean()
