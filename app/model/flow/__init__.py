"""CosyVoice2 flow: tokens + prompt -> mel (conformer encoder, causal CFM estimator, Euler solver)."""

from app.model.flow.flow import CausalFlow, fixed_noise, load_flow

__all__ = ["CausalFlow", "fixed_noise", "load_flow"]
