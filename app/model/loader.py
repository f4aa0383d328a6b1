"""Load a CosyVoice2 model folder in the official layout, unchanged.

Design notes: docs/model.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from app.model.flow import CausalFlow
from app.model.frontend import Frontend
from app.model.hift import HiFTGenerator, normalize_hift_state_dict
from app.model.hparams import ModelFolderError, ModelHParams, load_hparams
from app.model.llm import SpeechLM
from app.model.onnx_models import SpeakerEncoderOnnx, SpeechTokenizerOnnx
from app.model.text import TextFrontend
from app.model.tokenizer import SpeechTextTokenizer

REQUIRED_FILES = ("cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt", "campplus.onnx",
                  "speech_tokenizer_v2.onnx", "CosyVoice-BlankEN/config.json")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class CosyVoice2Model:
    """The loaded model, shared read-only by every request (no per-request state here)."""

    model_dir: Path
    hparams: ModelHParams
    frontend: Frontend
    llm: SpeechLM
    flow: CausalFlow
    hift: HiFTGenerator
    device: torch.device
    checkpoint_counts: dict[str, dict[str, int]]  # per file: {"tensors": n, "params": n} as stored


def cuda_available() -> bool:
    """Whether a CUDA GPU is there, asked without initialising CUDA: `torch.cuda.device_count()` asks NVML
    first (`is_available()` would call cuInit), so vLLM's engine processes spawned later start clean."""
    return torch.cuda.device_count() > 0


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if cuda_available() else "cpu")
    return torch.device(device)


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """`torch.load(path, weights_only=True)`, with a ModelFolderError naming a bad file."""
    if not path.is_file():
        raise ModelFolderError(f"missing {path}")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types (pickle, zip, RuntimeError) for bad files
        raise ModelFolderError(f"cannot load {path} (corrupt or not a state dict): {e}") from e
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ModelFolderError(f"{path} is not a plain state dict of tensors")
    return sd


def load_strict(module: nn.Module, path: Path,
                transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
                ) -> dict[str, int]:
    """Strict load of `path` into `module`; returns the file's tensor and parameter counts."""
    sd = read_state_dict(path)
    counts = {"tensors": len(sd), "params": sum(v.numel() for v in sd.values())}
    if transform is not None:
        sd = transform(sd)
    try:
        module.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise ModelFolderError(f"{path} does not match the sizes in cosyvoice2.yaml: {e}") from e
    return counts


def check_model_dir(model_dir: Path) -> None:
    if not model_dir.is_dir():
        raise ModelFolderError(f"model folder {model_dir} does not exist")
    missing = [f for f in REQUIRED_FILES if not (model_dir / f).is_file()]
    if missing:
        raise ModelFolderError(f"{model_dir} is not a CosyVoice2 folder: missing {', '.join(missing)}")


def load_frontend(model_dir: Path, hp: ModelHParams, *, device: torch.device,
                  text_frontend: bool = True) -> Frontend:
    tokenizer = SpeechTextTokenizer.from_dir(model_dir / "CosyVoice-BlankEN")
    prefer_cuda = device.type == "cuda"
    return Frontend(
        tokenizer=tokenizer,
        text=TextFrontend(backend="wetext" if text_frontend else "none", count_tokens=tokenizer.count_tokens),
        speech_tokenizer=SpeechTokenizerOnnx(model_dir / "speech_tokenizer_v2.onnx", prefer_cuda=prefer_cuda),
        speaker_encoder=SpeakerEncoderOnnx(model_dir / "campplus.onnx", prefer_cuda=False),
        feat=hp.feat, text_frontend=text_frontend)


def load_model(model_dir: str | Path, *, device: str = "auto", llm_dtype: str = "float32",
               flow_dtype: str = "float32", hift_dtype: str = "float32", text_frontend: bool = True,
               nsf_noise: bool = True) -> CosyVoice2Model:
    """Load every part of a CosyVoice2 folder; modules are in eval mode on `device`."""
    model_dir = Path(model_dir).expanduser().resolve()
    check_model_dir(model_dir)
    hp = load_hparams(model_dir)
    dev = resolve_device(device)

    counts = {}
    llm = SpeechLM(hp.llm)
    counts["llm"] = load_strict(llm, model_dir / "llm.pt")
    # Qwen's text lm_head (tied to embed_tokens in the file) is never used by the speech LM;
    # drop it so it costs no second copy of the 151936-row table after a dtype cast.
    llm.llm.model.lm_head = nn.Identity()
    flow = CausalFlow(hp.flow)
    counts["flow"] = load_strict(flow, model_dir / "flow.pt")
    hift = HiFTGenerator(hp.hift, nsf_noise=nsf_noise)
    counts["hift"] = load_strict(hift, model_dir / "hift.pt", transform=normalize_hift_state_dict)
    hift.remove_weight_norm()

    llm = llm.to(dev, _DTYPES[llm_dtype]).eval()
    flow = flow.to(dev, _DTYPES[flow_dtype]).eval()
    hift = hift.to(dev, _DTYPES[hift_dtype]).eval()
    hift.f0_predictor.float()  # f0 must be fp32 (see HiFTGenerator.f0)
    frontend = load_frontend(model_dir, hp, device=dev, text_frontend=text_frontend)
    return CosyVoice2Model(model_dir=model_dir, hparams=hp, frontend=frontend, llm=llm, flow=flow,
                           hift=hift, device=dev, checkpoint_counts=counts)
