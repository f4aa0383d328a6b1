"""AWQ calibration data sampled from the speech LM itself (no external data set exists for it).

Design notes: docs/design.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from app.config import SamplingConfig
from app.model.hparams import load_hparams
from app.model.llm import SPEECH_TOKEN_SIZE, SpeechLM
from app.model.sampling import ras_sample

# Sentences of the text-conditioned prefixes (mixed zh/en like CosyVoice2's training data).
CALIBRATION_TEXTS = (
    "Hello, this is a short sentence for calibrating the speech model.",
    "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。",
    "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest.",
    "今天天气很好，我们一起去公园散步吧。",
    "Please read the following numbers aloud: one, two, three, four, five, six, seven.",
    "在那个寒冷的冬天，他一个人走在回家的路上，心里想着远方的家人。",
    "Streaming speech synthesis makes the first sound arrive long before the sentence ends.",
    "我们需要更多的数据来训练一个更好的模型，不过时间已经不多了。",
)


# the sampler's settings; without a model folder (quantize without --model-dir): the official
# cosyvoice2.yaml's, the values RASParams in app/vllm_lm/ras.py defaults to
RASParams = SamplingConfig
OFFICIAL_RAS = SamplingConfig(top_p=0.8, top_k=25, win_size=10, tau_r=0.1)


def load_export_lm(export_dir: Path, *, dtype: torch.dtype | None = None) -> nn.Module:
    """The export folder as transformers' `Qwen2ForCausalLM`, with CosyVoice2's `lm_head.bias` restored.

    config.json says `Qwen2ForCausalLM`, whose lm_head has no bias; the export keeps the bias beside
    the weights (`app.model.vllm_export.HEAD_BIAS_FILE`), so the head is swapped for a biased Linear
    holding it (in the model's dtype). `dtype=None` keeps the export's dtype.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from app.model.vllm_export import ARCHITECTURE, load_head_bias

    export_dir = Path(export_dir)
    config = json.loads((export_dir / "config.json").read_text(encoding="utf-8"))
    if config.get("architectures") != [ARCHITECTURE] or "cosyvoice2_export" not in config:
        raise ValueError(f"{export_dir} is not a CosyVoice2 LM export (app.model.vllm_export): "
                         f"model_type {config.get('model_type')!r}, architectures {config.get('architectures')}")
    bias = load_head_bias(export_dir)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # keep the load report off the console
    try:
        model = AutoModelForCausalLM.from_pretrained(str(export_dir), dtype=dtype or "auto")
    finally:
        hf_logging.set_verbosity(verbosity)
    old = model.lm_head
    head = nn.Linear(old.in_features, old.out_features, bias=True, dtype=old.weight.dtype)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.copy_(bias)
    model.lm_head = head
    return model.eval()


@torch.inference_mode()
def text_prefixes(model_dir: Path, texts: tuple[str, ...] = CALIBRATION_TEXTS) -> list[Tensor]:
    """Real LM prefixes `[1, T_i, D]` (float32): sos + text embeddings + task_id, one per text."""
    from app.model.tokenizer import SpeechTextTokenizer

    model_dir = Path(model_dir)
    lm = SpeechLM(load_hparams(model_dir).llm)
    # strict load like app.model.loader (not imported: it pulls in the audio stack, absent in .venv-quant)
    lm.load_state_dict(torch.load(model_dir / "llm.pt", map_location="cpu", weights_only=True), strict=True)
    tokenizer = SpeechTextTokenizer.from_dir(model_dir / "CosyVoice-BlankEN")
    return [lm.build_lm_input(tokenizer.encode(t)) for t in texts]


@torch.inference_mode()
def sample_speech_tokens(model: nn.Module, prefix_embeds: Tensor, n_tokens: int, generator: torch.Generator,
                         ras: RASParams = OFFICIAL_RAS) -> Tensor:
    """Speech tokens `[B, n_tokens]` (ids < 6561) the LM samples after `prefix_embeds [B, T, D]`.

    KV-cached decoding with the official RAS per row (row order fixes the generator's draws);
    eos/fill/padded ids are never drawn, so every row gets exactly `n_tokens` tokens.
    """
    embed = model.get_input_embeddings()
    device = embed.weight.device
    rows: list[list[int]] = [[] for _ in range(prefix_embeds.shape[0])]
    out = model(inputs_embeds=prefix_embeds.to(device, embed.weight.dtype), use_cache=True, logits_to_keep=1)
    for step in range(n_tokens):
        # speech ids only: stop ids (6561-6563) and padded rows are banned by slicing them away
        logp = out.logits[:, -1, :SPEECH_TOKEN_SIZE].float().log_softmax(dim=-1).cpu()  # [B, 6561]
        for b, row in enumerate(rows):
            row.append(ras_sample(logp[b], row, generator, top_p=ras.top_p, top_k=ras.top_k,
                                  win_size=ras.win_size, tau_r=ras.tau_r))
        if step + 1 < n_tokens:
            last = torch.tensor([[row[-1]] for row in rows], device=device)  # [B, 1]
            out = model(input_ids=last, past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
    return torch.tensor(rows, dtype=torch.long)


@torch.inference_mode()
def calibration_samples(model: nn.Module, n_samples: int, seq_len: int, generator: torch.Generator, *,
                        prefixes: list[Tensor] | None = None, ras: RASParams = OFFICIAL_RAS,
                        ) -> list[dict[str, Tensor]]:
    """`n_samples` calibration inputs for `model(**sample)`, each with a batch dim of 1.

    Without `prefixes`: `{"input_ids": [1, seq_len]}`, a random first token then `seq_len - 1`
    sampled ones. With `prefixes` (`[1, T_i, D]`, see `text_prefixes`): sample i uses prefix
    i % len(prefixes) and is `{"inputs_embeds": [1, T_i + seq_len, D]}` (prefix, then the
    embeddings of `seq_len` sampled tokens). Rows sharing a prefix are decoded as one batch.
    """
    if n_samples < 1 or seq_len < 2:
        raise ValueError(f"need n_samples >= 1 and seq_len >= 2, got {n_samples}, {seq_len}")
    embed = model.get_input_embeddings()
    if prefixes is None:
        first = torch.randint(0, SPEECH_TOKEN_SIZE, (n_samples, 1), generator=generator)
        rest = sample_speech_tokens(model, embed(first.to(embed.weight.device)), seq_len - 1, generator, ras)
        return [{"input_ids": row[None]} for row in torch.cat([first, rest], dim=1)]

    samples: list[dict[str, Tensor] | None] = [None] * n_samples
    for j, prefix in enumerate(prefixes):
        idx = list(range(j, n_samples, len(prefixes)))
        if not idx:
            break
        batch_prefix = prefix.expand(len(idx), -1, -1)  # [b, T, D]
        tokens = sample_speech_tokens(model, batch_prefix, seq_len, generator, ras)  # [b, L]
        speech = embed(tokens.to(embed.weight.device)).cpu()  # [b, L, D]
        for k, i in enumerate(idx):
            row = torch.cat([prefix[0].to(speech.dtype), speech[k]], dim=0)  # [T + L, D]
            samples[i] = {"inputs_embeds": row[None]}
    return samples  # type: ignore[return-value]  # every index was filled above


def source_sampling(model_dir: Path, export_dir: Path, export_cfg: dict) -> tuple[RASParams, list[Tensor]]:
    """The model folder the export came from (checked by llm.pt's hash) -> its sampling and text prefixes."""
    from app.model.vllm_export import file_sha256

    if not (model_dir / "llm.pt").is_file():
        raise ValueError(f"--model-dir {model_dir} has no llm.pt: not a CosyVoice2 model folder")
    want = export_cfg.get("cosyvoice2_export", {}).get("llm_pt_sha256")
    if want and file_sha256(model_dir / "llm.pt") != want:
        raise ValueError(f"--model-dir {model_dir} is not the folder {export_dir} was exported from "
                         "(llm.pt content differs)")
    d = load_hparams(model_dir).llm
    return RASParams(top_p=d.top_p, top_k=d.top_k, win_size=d.win_size, tau_r=d.tau_r), text_prefixes(model_dir)
