"""Pure torch/ONNX CosyVoice2: loader, frontend, speech LM, flow, HiFT. No engine, no UI."""
