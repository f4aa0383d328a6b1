#!/usr/bin/env bash
# On the lent H200 (vllm 0.26.0 from .carry1, no network): build a `full` random model, then
# benchmark the vLLM speech LM (bf16) at 1/16/64 streams. Writes JSON reports to $OUT.
#   run(carry=[".carry1"], command="bash scripts/gpu_lm_bench.sh")
set -uo pipefail
[ -f /tmp/vllm_env.sh ] || bash .carry1/install_vllm.sh || exit 3
. scripts/gpu_env.sh || exit 3
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
[ -f /tmp/full/llm.pt ] || python3 -m app.tools.make_model /tmp/full --size full --force | tee "$OUT/make_full.json"
[ "${SKIP_BF16:-0}" = 1 ] || python3 -m bench.lm --model-dir /tmp/full --device cuda --conc ${CONC:-1,16,64} --tokens 300 \
  --reps ${REPS:-2} --out "$OUT/bench_lm_bf16.json" 2>&1 | grep -v -E "^(INFO|DEBUG)" | tail -40
# AWQ=1: the same benchmark on a W4A16 checkpoint of the same LM (round-to-nearest: llm-compressor
# cannot be installed on the offline GPU machine, and calibration means nothing on random weights)
if [ "${AWQ:-0}" = 1 ]; then
  exp=$(python3 -c "from pathlib import Path; from app.model.vllm_export import export_lm_for_vllm as e; \
print(e(Path('/tmp/full'), Path('~/.cache/cosyvoice2-studio/vllm').expanduser(), dtype='bfloat16'))")
  python3 -m app.tools.quantize_rtn "$exp" /tmp/full-w4a16 --force | tee "$OUT/quantize_rtn_full.json"
  printf '[vllm]\nquantized_dir = "/tmp/full-w4a16"\n' > /tmp/w4a16.toml
  python3 -m bench.lm --model-dir /tmp/full --device cuda --config /tmp/w4a16.toml \
    --conc ${CONC:-1,16,64} --tokens 300 --reps ${REPS:-2} --out "$OUT/bench_lm_w4a16.json" 2>&1 \
    | grep -v -E "^(INFO|DEBUG)|^\(EngineCore" | tail -20
fi
