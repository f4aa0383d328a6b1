"""CosyVoice2's lm_head bias and repetition-aware sampling (RAS) inside vLLM: a v1 custom logits processor.
Design notes: docs/design.md."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from app.model.llm import N_SPEECH_ROWS
from app.model.ras_batch import EXTRA_ARGS_KEY, RASBatch, RASParams, ras_log_probs
from app.model.ras_graphs import RASGraphs
from app.model.vllm_export import load_head_bias
from app.vllm_lm import ENGINE_OPTIONS_KEY
from app.vllm_lm import model as vllm_model
from app.vllm_lm.w4a16 import install_if_needed

try:  # importable where vLLM is not installed (the class below is then unusable)
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
    from vllm.v1.utils import record_function_or_nullcontext  # a profiler range with VLLM_CUSTOM_SCOPES_FOR_PROFILING
except ImportError:  # pragma: no cover - torch-only installs
    BatchUpdate = Any  # type: ignore[misc,assignment]
    LogitsProcessor = object  # type: ignore[misc,assignment]
    MoveDirectionality = None  # type: ignore[assignment]

    def record_function_or_nullcontext(name: str) -> contextlib.nullcontext:  # type: ignore[misc]
        return contextlib.nullcontext()


class RASLogitsProcessor(LogitsProcessor):
    """vLLM v1 logits processor: the lm_head bias on every row, then per-request official RAS."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        self.pin = bool(is_pin_memory)
        # [V] float32 lm_head bias of the folder the engine serves; None only without a vllm_config (bookkeeping
        # tests on bare logits). The engine's V may be the speech rows only (app.vllm_lm.model), the file has the
        # table's rows.
        self.head_bias = None
        if vllm_config is not None:  # vLLM builds logits processors before the model: 4-bit layers on
            install_if_needed()  # CPUs whose vLLM build lacks the W4A16 GEMM (app.vllm_lm.w4a16)
            vllm_model.register()  # and the architecture the engine's hf_overrides name
            mc = vllm_config.model_config
            bias = load_head_bias(Path(mc.model))[:mc.get_vocab_size()]
            if bias.shape != (mc.get_vocab_size(),) or bias.shape[0] < N_SPEECH_ROWS:
                raise ValueError(f"{mc.model}: lm_head bias has shape {tuple(bias.shape)}, the vocabulary is "
                                 f"{mc.get_vocab_size()}; export the LM again")
            self.head_bias = bias.to(self.device)
        # batch row -> (settings, the request's output token list; vLLM appends to it in place)
        self.rows: dict[int, tuple[RASParams, list[int]]] = {}
        self._cache: tuple[Tensor, list[list[int]], RASBatch] | None = None
        # GPU: the RAS math replayed as one CUDA graph per batch layout (app/model/ras_graphs.py), unless our
        # options in the engine's config (app/engine/vllm_start.py:engine_kwargs) say {"ras_cuda_graphs": False}
        extra = getattr(vllm_config, "additional_config", None)  # None without a vllm_config
        opts = extra.get(ENGINE_OPTIONS_KEY) if isinstance(extra, dict) else None
        graphs = self.device.type == "cuda" and (opts if isinstance(opts, dict) else {}).get("ras_cuda_graphs", True)
        self.graphs = RASGraphs() if graphs else None

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        """Reject bad settings, and vLLM sampling options that would distort the RAS draw or miss the bias."""
        sp = sampling_params
        if sp.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are computed before logits processors, so they would lack "
                             "CosyVoice2's lm_head bias (added by app.vllm_lm.ras); leave them unset")
        if RASParams.from_extra_args(sp.extra_args) is None:
            return
        clash = []
        if sp.top_p != 1.0 or sp.top_k not in (0, -1) or sp.min_p != 0.0:
            clash.append("top_p/top_k/min_p (RAS does its own nucleus)")
        if sp.temperature not in (0.0, 1.0):
            clash.append("temperature (1 samples from RAS, 0 takes its argmax)")
        if sp.min_tokens:
            clash.append(f"min_tokens (it bans every stop id; use {EXTRA_ARGS_KEY}.min_tokens)")
        if sp.repetition_penalty != 1.0 or sp.presence_penalty or sp.frequency_penalty:
            clash.append("penalties")
        if clash:
            raise ValueError(f"requests with extra_args[{EXTRA_ARGS_KEY!r}] must leave vLLM's "
                             f"{', '.join(clash)} at their defaults")

    def is_argmax_invariant(self) -> bool:
        return False  # the RAS distribution can move the argmax (repeats, eos ban, padding)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        # documented order: removed, added, moved
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt_ids, output_ids in batch_update.added:
            ras = RASParams.from_extra_args(params.extra_args) if params is not None else None
            if ras is None:
                self.rows.pop(index, None)
            else:
                self.rows[index] = (ras, output_ids)
        for a, b, direction in batch_update.moved:
            row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if row_a is not None:
                self.rows[b] = row_a
            if row_b is not None and direction == MoveDirectionality.SWAP:
                self.rows[a] = row_b
        self._cache = None

    def apply(self, logits: Tensor) -> Tensor:
        with record_function_or_nullcontext("cosyvoice2: RAS logits processor"):
            if self.head_bias is not None:  # logits [R, V] float32 (vLLM's sampler converts before us)
                logits.add_(self.head_bias)
            if not self.rows:
                return logits
            if self._cache is None:
                order = sorted(self.rows)
                batch = RASBatch.build([self.rows[i][0] for i in order], logits.device, self.pin)
                index = torch.tensor(order, device=logits.device)
                self._cache = (index, [self.rows[i][1] for i in order], batch)
            index, outputs, batch = self._cache
            history, ban_eos = batch.history(outputs, logits.device)
            every = len(outputs) == logits.shape[0]  # every row is a RAS row (rows are 0..R-1): no gather
            rows = logits if every else logits.index_select(0, index)
            if self.graphs is not None and logits.dtype == torch.float32:
                new = self.graphs(rows, batch, history, ban_eos)  # a static buffer: copied out below
                return logits.copy_(new) if every else logits.index_copy_(0, index, new)
            dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
            new = ras_log_probs(rows, batch, history, ban_eos, dtype).to(logits.dtype)
            return new if every else logits.index_copy_(0, index, new)
