"""CosyVoice2 Studio: zero-shot voice cloning served through vLLM."""
