#!/usr/bin/env bash
# On the lent H200 (issue 27): the speech LM's per-step levers, LM alone (bench/lm.py, `full` random model,
# bf16, 300 tokens): the RAS step eager vs CUDA graphs, async scheduling off, a saved voice's prefix with and
# without vLLM's prefix cache, and one profiled request. Reports land in $OUT.
#   run(carry=[".carry1", ...]): bash .carry1/install_vllm.sh && . /tmp/vllm_env.sh && STEPS='...' bash scripts/gpu_lm_levers.sh
# STEPS (space-separated): ras (scripts/gpu_ras_graphs.py: graphed == eager bit for bit, ms per step)
#   | eager_ras | graphs | noasync | prefix | noprefix | profile
set -uo pipefail
. scripts/gpu_env.sh || exit 3
[ -f /tmp/full/llm.pt ] || python3 -m app.tools.make_model /tmp/full --size full --force > "$OUT/make_full.json" || exit 4
lm() {  # lm TAG ARGS...: one bench.lm run -> $OUT/lm_TAG.json (levels printed)
  local tag=$1; shift
  echo "=== $tag $*"
  timeout ${LM_TIMEOUT:-150} python3 -m bench.lm --model-dir /tmp/full --device cuda --tokens 300 --reps ${REPS:-2} \
    --out "$OUT/lm_$tag.json" "$@" 2>&1 | grep -E "^BENCH_LM|Error|error|RAS CUDA graph|synchronous scheduling|Traceback" | head -30
}
for step in ${STEPS:-ras eager_ras graphs noasync}; do
  case $step in
    ras) timeout 90 python3 scripts/gpu_ras_graphs.py "$OUT/ras_graphs.json" 2>&1 | tail -8 ;;
    eager_ras) lm eager_ras --conc ${CONC:-1,64} --set vllm.ras_cuda_graphs=false ;;
    graphs) lm graphs --conc ${CONC:-1,64} ;;
    noasync) lm noasync --conc 1 --set 'vllm.async_scheduling="off"' ;;
    prefix) lm prefix --conc 1 --voice-prefix 30 --prompt-tokens 150 ;;
    noprefix) lm noprefix --conc 1 --voice-prefix 30 --prompt-tokens 150 --set vllm.enable_prefix_caching=false ;;
    profile) rm -rf /tmp/prof; VLLM_CUSTOM_SCOPES_FOR_PROFILING=1 lm profile --conc 1 --reps 1 --profile-dir /tmp/prof
      python3 scripts/trace_summary.py /tmp/prof "$OUT/profile_summary.json" 2>&1 | tail -12 ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
