"""Random-weight CosyVoice2 checkpoints in the official folder layout (a library).

Design notes: docs/model.md.
"""

from app.model.random.make import make_model
from app.model.random.sizes import FULL, SIZES, TINY, ModelSize

__all__ = ["FULL", "SIZES", "TINY", "ModelSize", "make_model"]
