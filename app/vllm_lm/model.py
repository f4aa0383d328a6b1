"""vLLM's Qwen2 with CosyVoice2's two tables: prompts embed through the whole id space (speech, sos/task_id,
text: app.model.llm.build_lm_ids) while the head and sampler see only the speech vocabulary."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch

from app.model.llm import SPEECH_ID_ROWS

ARCHITECTURE = "CosyVoice2ForCausalLM"  # named by the engine's hf_overrides, never by the export's config.json
EMBED_ROWS_KEY = "cosyvoice2_embed_rows"  # hf_overrides: rows of the id space's table (the export's vocab)


def hf_overrides(export_config: dict[str, Any]) -> dict[str, Any]:
    """The engine's view of a stock export: this architecture, a vocabulary of the speech rows (what is
    sampled), and the export's whole table for the prompt's ids."""
    return {"architectures": [ARCHITECTURE], "vocab_size": SPEECH_ID_ROWS,
            EMBED_ROWS_KEY: export_config["vocab_size"]}


def register() -> None:
    """Make ARCHITECTURE known to vLLM in this process (the app's, and the engine's: the RAS processor calls
    it there, before vLLM builds the model). Idempotent."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, model_class())


@functools.cache
def model_class() -> type:
    """vLLM's Qwen2ForCausalLM with the id space's table as its embedding (built here: vLLM is imported
    only where an engine runs)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    class CosyVoice2ForCausalLM(Qwen2ForCausalLM):
        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            config = vllm_config.model_config.hf_config
            # [rows, D]: the export's table; lm_head keeps config.vocab_size (the speech rows) only
            self.model.embed_tokens = VocabParallelEmbedding(
                getattr(config, EMBED_ROWS_KEY), config.hidden_size, quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.model.embed_tokens" if prefix else "model.embed_tokens")

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            rows = self.config.vocab_size
            # the export's lm_head has the table's rows (stock Qwen2 ties the two sizes); past `rows` all 0
            return super().load_weights((n, w[:rows] if n == "lm_head.weight" else w) for n, w in weights)

    return CosyVoice2ForCausalLM
