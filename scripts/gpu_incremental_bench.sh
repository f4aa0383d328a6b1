#!/usr/bin/env bash
# On the lent H200 (issue 16): the whole pipeline with the incremental flow vs today's re-solve,
# 250-token requests at 1 and 16 streams, and one 1,500-token segment (flow ms per emitted frame by
# chunk position: `flow_ms_per_frame_by_chunk` in the report). Reports land in $OUT as sweep_<step>.json.
#   run(carry=[".carry1"], command="bash .carry1/install_vllm.sh && STEPS='base inc' bash scripts/gpu_incremental_bench.sh")
# STEPS (space-separated): base | inc | fast | fast_inc | long_base | long_fast | long_inc | hops (the flow alone:
# incremental hops batched vs alone vs the re-solve at 1/4/16 streams, fp32 and fp16, and the states'
# memory: scripts/gpu_incremental_graphs.py -> incremental_hops_{float32,float16}.json). INC_GIB: flow_state_gib for
# the incremental steps (default 90: the H200 has ~139 GiB; vLLM keeps a 2 GiB KV cache).
set -uo pipefail
. scripts/gpu_env.sh || exit 3
echo "Hello." > /tmp/one_segment.txt  # one short sentence: one text segment, its length set by FIXED
INC="engine.flow_incremental=true engine.flow_state_gib=${INC_GIB:-90}"
for step in ${STEPS:-base inc long_base long_inc}; do
  echo "=== $step"
  case $step in
    base) TAG=$step PREFLIGHT=0 CONC=${CONC:-1,16} VOICE=saved RPS=2 SWEEP_TIMEOUT=240 bash scripts/gpu_serve_bench.sh ;;
    inc) TAG=$step PREFLIGHT=0 CONC=${CONC:-1,16} VOICE=saved RPS=2 SETS="$INC" SWEEP_TIMEOUT=240 \
      bash scripts/gpu_serve_bench.sh ;;
    fast) TAG=$step PREFLIGHT=0 CONC=${CONC:-1,16} VOICE=saved RPS=2 CONFIG=configs/fast.toml SWEEP_TIMEOUT=240 \
      bash scripts/gpu_serve_bench.sh ;;
    fast_inc) TAG=$step PREFLIGHT=0 CONC=${CONC:-1,16} VOICE=saved RPS=2 CONFIG=configs/fast.toml SETS="$INC" \
      SWEEP_TIMEOUT=240 bash scripts/gpu_serve_bench.sh ;;
    long_base) TAG=$step PREFLIGHT=0 CONC=1 FIXED=1500 VOICE=saved RPS=2 WARMUP=0 TEXTS=/tmp/one_segment.txt \
      SWEEP_TIMEOUT=240 bash scripts/gpu_serve_bench.sh ;;
    long_fast) TAG=$step PREFLIGHT=0 CONC=1 FIXED=1500 VOICE=saved RPS=2 WARMUP=0 TEXTS=/tmp/one_segment.txt \
      CONFIG=configs/fast.toml SWEEP_TIMEOUT=240 bash scripts/gpu_serve_bench.sh ;;
    long_inc) TAG=$step PREFLIGHT=0 CONC=1 FIXED=1500 VOICE=saved RPS=2 WARMUP=0 TEXTS=/tmp/one_segment.txt \
      SETS="$INC" SWEEP_TIMEOUT=240 bash scripts/gpu_serve_bench.sh ;;
    hops) for dt in float32 float16; do
        timeout 500 python3 scripts/gpu_incremental_graphs.py "$OUT/incremental_hops_$dt.json" --dtype $dt 2>&1 \
          | grep -v Warning | tail -8
      done
      continue ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
  python3 - "$OUT/sweep_$step.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"no report: {e}")
for lv in r.get("levels", []):
    print({k: lv.get(k) for k in ("concurrency", "n", "errors", "ttfa_p50_ms", "ttfa_p95_ms", "rtf_p50",
                                  "audio_s_per_s", "gpu_mem_gb", "flow_p50_s", "stalls")})
    f = lv.get("flow_ms_per_frame_by_chunk")
    if f:
        print("flow ms/frame by chunk:", f)
PY
done
