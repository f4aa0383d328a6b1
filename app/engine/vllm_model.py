"""`CosyVoice2ForCausalLM`: vLLM's Qwen2 causal LM with a biased lm_head (CosyVoice2's llm_decoder).

Loaded by vLLM from an `app.model.vllm_export` folder: embed_tokens = the speech-token table,
lm_head.weight/bias = llm_decoder. Everything else (attention, KV cache, CUDA graphs,
quantized linears, `embed_input_ids` for fed-back speech tokens) is the stock Qwen2 class.
Checked against vllm 0.26.0 and 0.32.0: both have `compute_logits(hidden_states)` and
`LogitsProcessor(lm_head, hidden_states, embedding_bias)`. Registered by `app.engine.vllm_plugin`.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.utils import maybe_prefix


class CosyVoice2ForCausalLM(Qwen2ForCausalLM):
    """Qwen2 backbone over speech-token embeddings; logits = lm_head(h) + bias, vocab 6592 (6564 real)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if self.config.tie_word_embeddings:
            raise ValueError("CosyVoice2ForCausalLM needs tie_word_embeddings=false (a separate biased head)")
        if get_pp_group().is_last_rank:
            # replaces the bias-free head the parent built (the same shape, plus `lm_head.bias`)
            self.lm_head = ParallelLMHead(self.config.vocab_size, self.config.hidden_size, bias=True,
                                          quant_config=vllm_config.quant_config,
                                          prefix=maybe_prefix(prefix, "lm_head"))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states, self.lm_head.bias)
