"""The speech LM as vLLM runs it, loaded into vLLM's engine processes by name: the model class (model.py), the
RAS logits processor (ras.py), the CPU 4-bit kernel (w4a16.py). app/engine starts the engine; this room runs in it.
Importing the package imports neither torch nor vLLM (app/engine/vllm_start.py reads the names below)."""

# the engine's additional_config key for the processor's options (read by ras.py)
ENGINE_OPTIONS_KEY = "cosyvoice2"
# always loaded: it adds the lm_head bias (the stock Qwen2 head has none), and does RAS where asked
RAS_PROCESSOR = "app.vllm_lm.ras:RASLogitsProcessor"
