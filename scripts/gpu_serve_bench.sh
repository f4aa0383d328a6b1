#!/usr/bin/env bash
# On the lent H200: the whole studio pipeline (frontend, vLLM LM, flow, HiFT) in-process on a `full`
# random model, swept at 1/16/64 streams with fixed-length outputs, then the memory experiment.
# Reports (JSON) land in $OUT; render PNGs here later with `python -m bench plot`.
#   run(carry=[".carry1"]), run(carry=[".carry2"], command="bash .carry2/install_vllm.sh && bash scripts/gpu_serve_bench.sh")
# Knobs (env): TAG (report name), CONC (1,16,64), FIXED (fixed_tokens, 250), RPS (requests per stream, 3),
#   VOICE (saved,new), SETS ("k=v k=v": config overrides), CONFIG (an override file, e.g. configs/fast.toml), MEMORY (1 = also the memory experiment),
#   PREFLIGHT (1 = one synthesis through the CLI first), TEXTS (a file, one text per line), WARMUP (rounds, 1)
set -uo pipefail
. scripts/gpu_env.sh || exit 3
TAG=${TAG:-base}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
[ -f /tmp/full/llm.pt ] || python3 -m app.tools.make_model /tmp/full --size full --force > "$OUT/make_full.json" 2>&1 \
  || { tail -20 "$OUT/make_full.json"; exit 4; }
sets=()
for kv in ${SETS:-}; do sets+=(--set "$kv"); done
[ -n "${CONFIG:-}" ] && sets+=(--config "$CONFIG")
filter() { grep -v -E "^(INFO|DEBUG)|^\((EngineCore|MainProcess|APIServer)|WARNING" ; }
if [ "${PREFLIGHT:-1}" = 1 ]; then
  timeout 300 python3 -m app.tools.synthesize --stream \
    --model-dir /tmp/full --text "Hello there, how are you today?" --prompt-wav assets/prompt_en.wav \
    --prompt-text "$(python3 -c 'import json;print(json.load(open("assets/examples.json"))["voices"][0]["transcript"])')" \
    --out "$OUT/preflight.wav" 2>&1 | filter | tail -15
fi
timeout "${SWEEP_TIMEOUT:-560}" python3 -m bench sweep --model-dir /tmp/full --conc "${CONC:-1,16,64}" \
  --fixed-tokens "${FIXED:-250}" --requests-per-stream "${RPS:-3}" --voice "${VOICE:-saved,new}" --warmup "${WARMUP:-1}" \
  --texts "${TEXTS:-default}" \
  "${sets[@]}" --out "$OUT/sweep_${TAG}.json" 2>&1 | filter | tail -40
if [ "${MEMORY:-0}" = 1 ]; then
  timeout 400 python3 -m bench memory --model-dir /tmp/full --max-model-len 1024,2048,4096 \
    --gpu-util 0.03,0.06,0.15 --set vllm.enforce_eager=true --out "$OUT/memory.json" 2>&1 | filter | tail -30
fi
nvidia-smi --query-gpu=memory.used --format=csv,noheader
