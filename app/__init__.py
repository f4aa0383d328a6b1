"""CosyVoice2 Studio: zero-shot voice cloning served through vLLM."""

__version__ = "0.1.0"  # = pyproject.toml's version (the repository is never installed on a Space)
