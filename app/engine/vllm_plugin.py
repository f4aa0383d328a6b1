"""vLLM general plugin (entry point `vllm.general_plugins: cosyvoice2`, see pyproject.toml).

vLLM calls `register()` in every process it starts (front end, engine core, workers), which is
why a registration in our own code would not reach the spawned engine processes. It needs the
project installed (`pip install -e .`, done by scripts/setup_*.sh) so the entry point exists.
The model class is registered lazily by name: nothing is imported here until vLLM needs it.
"""

from __future__ import annotations

ARCHITECTURE = "CosyVoice2ForCausalLM"
MODEL_CLASS = "app.engine.vllm_model:CosyVoice2ForCausalLM"


def register() -> None:
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
