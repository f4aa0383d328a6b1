"""Random-weight CosyVoice2 checkpoints in the official folder layout (a library).

`make_model(out, size, seed)` writes cosyvoice2.yaml, llm.pt, flow.pt, hift.pt, the two ONNX
stand-ins and CosyVoice-BlankEN/: `TINY` for tests and the offline demo, `FULL` with the real
model's shapes and FLOPs for GPU benchmarks. Used by the tests, by the offline fallback
(app/model/source.py) and by the thin CLI `python -m app.tools.make_model`.
"""

from app.model.random.make import make_model
from app.model.random.sizes import FULL, SIZES, TINY, ModelSize

__all__ = ["FULL", "SIZES", "TINY", "ModelSize", "make_model"]
