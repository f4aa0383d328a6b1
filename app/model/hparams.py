"""Numeric hyper-parameters of a CosyVoice2 model folder.

Design notes: docs/model.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from app.model import hyperpyyaml


class ModelFolderError(ValueError):
    """A model folder is missing a file or holds one that cannot be read; the message names it."""


@dataclass(frozen=True)
class QwenDims:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int  # text vocabulary rows of embed_tokens (151936 for the real model)
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class LLMDims:
    llm_input_size: int  # width of llm_embedding / speech_embedding rows
    llm_output_size: int  # width fed to llm_decoder
    speech_token_size: int  # 6561 real speech tokens; +3 specials (eos 6561, 6562, fill 6563)
    mix_ratio: tuple[int, int]  # bistream: text tokens, speech tokens per block
    top_p: float
    top_k: int
    win_size: int
    tau_r: float
    qwen: QwenDims


@dataclass(frozen=True)
class EncoderDims:
    input_size: int
    output_size: int
    attention_heads: int
    linear_units: int
    num_blocks: int
    num_up_blocks: int  # fixed at 4 in the official class
    static_chunk_size: int  # tokens per streaming chunk (25)


@dataclass(frozen=True)
class EstimatorDims:
    in_channels: int  # 4 * 80: x, mu, spks, cond
    out_channels: int
    channels: tuple[int, ...]
    attention_head_dim: int
    n_blocks: int
    num_mid_blocks: int
    num_heads: int
    static_chunk_size: int  # mel frames per streaming chunk (50)
    num_decoding_left_chunks: int


@dataclass(frozen=True)
class FlowDims:
    input_size: int  # token embedding width
    output_size: int  # mel channels (80)
    spk_embed_dim: int  # 192
    vocab_size: int  # 6561
    token_mel_ratio: int
    pre_lookahead_len: int
    encoder: EncoderDims
    estimator: EstimatorDims
    spk_emb_dim: int  # 80: projected speaker embedding
    inference_cfg_rate: float  # 0.7
    t_scheduler: str  # 'cosine'
    n_timesteps: int  # 10, hard-coded in the official flow.inference


@dataclass(frozen=True)
class HiftDims:
    in_channels: int
    base_channels: int
    nb_harmonics: int
    sampling_rate: int
    nsf_alpha: float
    nsf_sigma: float
    nsf_voiced_threshold: float
    upsample_rates: tuple[int, ...]
    upsample_kernel_sizes: tuple[int, ...]
    istft_n_fft: int
    istft_hop_len: int
    resblock_kernel_sizes: tuple[int, ...]
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    source_resblock_kernel_sizes: tuple[int, ...]
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    lrelu_slope: float
    audio_limit: float
    f0_cond_channels: int

    @property
    def upsample_factor(self) -> int:
        """Output samples per mel frame (480 for 8*5*3*4)."""
        total = self.istft_hop_len
        for r in self.upsample_rates:
            total *= r
        return total


@dataclass(frozen=True)
class FeatDims:
    """Prompt mel (matcha mel_spectrogram) parameters."""

    n_fft: int
    num_mels: int
    sampling_rate: int
    hop_size: int
    win_size: int
    fmin: float
    fmax: float | None
    center: bool


@dataclass(frozen=True)
class ModelHParams:
    sample_rate: int
    token_frame_rate: int
    token_mel_ratio: int
    chunk_size: int
    llm: LLMDims
    flow: FlowDims
    hift: HiftDims
    feat: FeatDims


# --- HyperPyYAML reading -------------------------------------------------------------------


def read_hyperpyyaml(path: Path) -> dict[str, Any]:
    """Read a HyperPyYAML file as plain data: class tags dropped, `!ref`s resolved."""
    try:
        raw = hyperpyyaml.load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise ModelFolderError(f"cannot read {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ModelFolderError(f"{path} is not a YAML mapping")
    return hyperpyyaml.resolve(raw)


# --- extraction -----------------------------------------------------------------------------


def _num(d: dict[str, Any], key: str, where: str) -> Any:
    try:
        return d[key]
    except KeyError as e:
        raise ModelFolderError(f"{where}: missing key {key!r}") from e


def _qwen_dims(config_path: Path) -> QwenDims:
    try:
        cfg = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFolderError(f"cannot read {config_path}: {e}") from e
    w = str(config_path)
    return QwenDims(
        hidden_size=int(_num(cfg, "hidden_size", w)),
        num_layers=int(_num(cfg, "num_hidden_layers", w)),
        num_heads=int(_num(cfg, "num_attention_heads", w)),
        num_kv_heads=int(cfg.get("num_key_value_heads", cfg["num_attention_heads"])),
        intermediate_size=int(_num(cfg, "intermediate_size", w)),
        vocab_size=int(_num(cfg, "vocab_size", w)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", 1e6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
    )


def _hift_dims(hift: dict[str, Any], where: str) -> HiftDims:
    """The vocoder's section of cosyvoice2.yaml (`hift`) -> `HiftDims`."""
    istft = _num(hift, "istft_params", where)
    f0 = _num(hift, "f0_predictor", where)
    return HiftDims(
        in_channels=int(hift["in_channels"]), base_channels=int(hift["base_channels"]),
        nb_harmonics=int(hift["nb_harmonics"]), sampling_rate=int(hift["sampling_rate"]),
        nsf_alpha=float(hift["nsf_alpha"]), nsf_sigma=float(hift["nsf_sigma"]),
        nsf_voiced_threshold=float(hift["nsf_voiced_threshold"]),
        upsample_rates=tuple(int(v) for v in hift["upsample_rates"]),
        upsample_kernel_sizes=tuple(int(v) for v in hift["upsample_kernel_sizes"]),
        istft_n_fft=int(istft["n_fft"]), istft_hop_len=int(istft["hop_len"]),
        resblock_kernel_sizes=tuple(int(v) for v in hift["resblock_kernel_sizes"]),
        resblock_dilation_sizes=tuple(tuple(int(d) for d in ds) for ds in hift["resblock_dilation_sizes"]),
        source_resblock_kernel_sizes=tuple(int(v) for v in hift["source_resblock_kernel_sizes"]),
        source_resblock_dilation_sizes=tuple(
            tuple(int(d) for d in ds) for ds in hift["source_resblock_dilation_sizes"]),
        lrelu_slope=float(hift.get("lrelu_slope", 0.1)), audio_limit=float(hift.get("audio_limit", 0.99)),
        f0_cond_channels=int(f0["cond_channels"]),
    )


def hparams_from_dict(y: dict[str, Any], qwen: QwenDims, where: str = "cosyvoice2.yaml") -> ModelHParams:
    """Build `ModelHParams` from resolved yaml data (see `read_hyperpyyaml`)."""
    llm, flow, hift = (_num(y, k, where) for k in ("llm", "flow", "hift"))
    samp = _num(llm, "sampling", f"{where}:llm")
    enc = _num(flow, "encoder", f"{where}:flow")
    dec = _num(flow, "decoder", f"{where}:flow")
    est = _num(dec, "estimator", f"{where}:flow.decoder")
    cfm = dec.get("cfm_params", {})
    cfm = cfm.get("content", cfm)
    feat = _num(y, "feat_extractor", where)
    llm_dims = LLMDims(
        llm_input_size=int(llm["llm_input_size"]), llm_output_size=int(llm["llm_output_size"]),
        speech_token_size=int(llm["speech_token_size"]),
        mix_ratio=tuple(int(v) for v in llm.get("mix_ratio", (5, 15))),
        top_p=float(samp.get("top_p", 0.8)), top_k=int(samp.get("top_k", 25)),
        win_size=int(samp.get("win_size", 10)), tau_r=float(samp.get("tau_r", 0.1)), qwen=qwen,
    )
    enc_dims = EncoderDims(
        input_size=int(enc.get("input_size", enc["output_size"])), output_size=int(enc["output_size"]),
        attention_heads=int(enc["attention_heads"]), linear_units=int(enc["linear_units"]),
        num_blocks=int(enc["num_blocks"]), num_up_blocks=4, static_chunk_size=int(enc["static_chunk_size"]),
    )
    est_dims = EstimatorDims(
        in_channels=int(est["in_channels"]), out_channels=int(est["out_channels"]),
        channels=tuple(int(c) for c in est["channels"]), attention_head_dim=int(est["attention_head_dim"]),
        n_blocks=int(est["n_blocks"]), num_mid_blocks=int(est["num_mid_blocks"]),
        num_heads=int(est["num_heads"]), static_chunk_size=int(est["static_chunk_size"]),
        num_decoding_left_chunks=int(est.get("num_decoding_left_chunks", -1)),
    )
    flow_dims = FlowDims(
        input_size=int(flow["input_size"]), output_size=int(flow["output_size"]),
        spk_embed_dim=int(flow["spk_embed_dim"]), vocab_size=int(flow["vocab_size"]),
        token_mel_ratio=int(flow["token_mel_ratio"]), pre_lookahead_len=int(flow["pre_lookahead_len"]),
        encoder=enc_dims, estimator=est_dims, spk_emb_dim=int(dec.get("spk_emb_dim", 80)),
        inference_cfg_rate=float(cfm.get("inference_cfg_rate", 0.7)),
        t_scheduler=str(cfm.get("t_scheduler", "cosine")), n_timesteps=10,
    )
    hift_dims = _hift_dims(hift, f"{where}:hift")
    feat_dims = FeatDims(
        n_fft=int(feat["n_fft"]), num_mels=int(feat["num_mels"]), sampling_rate=int(feat["sampling_rate"]),
        hop_size=int(feat["hop_size"]), win_size=int(feat["win_size"]), fmin=float(feat["fmin"]),
        fmax=None if feat.get("fmax") is None else float(feat["fmax"]), center=bool(feat["center"]),
    )
    return ModelHParams(
        sample_rate=int(y["sample_rate"]), token_frame_rate=int(y["token_frame_rate"]),
        token_mel_ratio=int(y["token_mel_ratio"]), chunk_size=int(y.get("chunk_size", 25)),
        llm=llm_dims, flow=flow_dims, hift=hift_dims, feat=feat_dims,
    )


def load_hparams(model_dir: str | Path) -> ModelHParams:
    """Read `cosyvoice2.yaml` and `CosyVoice-BlankEN/config.json` of a model folder."""
    model_dir = Path(model_dir)
    yaml_path = model_dir / "cosyvoice2.yaml"
    qwen_cfg = model_dir / "CosyVoice-BlankEN" / "config.json"
    for p in (yaml_path, qwen_cfg):
        if not p.is_file():
            raise ModelFolderError(f"missing {p}: is {model_dir} a CosyVoice2-0.5B folder?")
    try:
        return hparams_from_dict(read_hyperpyyaml(yaml_path), _qwen_dims(qwen_cfg), str(yaml_path))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ModelFolderError):
            raise
        raise ModelFolderError(f"{yaml_path}: unexpected hyper-parameter layout ({e!r})") from e
