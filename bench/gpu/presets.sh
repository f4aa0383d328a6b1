#!/usr/bin/env bash
# The shipped presets on one GPU, shaped for scarce machines: each PART is one device call (install + its
# sweeps, the new side first), every sweep writing its report after each level so a call cut short keeps
# what it measured. Run from the checkout's root with vLLM carried (docs/gpu_runs.md):
#
#   bash .carry1/install_vllm.sh && bash bench/gpu/presets.sh 1     # then, on the same warm machine:
#   bash bench/gpu/presets.sh 2                                      # (a cold one: the install again first)
#
# PART 1, the A/B pair: default.toml as shipped (the official fp16 mode on the packed O(chunk) path, calls
#   sized by deadline) at 1 / 16 / 64 streams, then the fp16 re-solve (engine.flow_incremental=false) there.
# PART 2: the engine's capacity (default.toml, the LM's batch lifted to 128 streams: levels 16 ... 128), then
#   fast.toml as shipped at 1 / 16 / 64.
# PART 3: exact.toml (the fp32 flow) at 1 / 16 / 64, then one 1,500-token segment on the default, then what the
#   word-timings aligner costs (turbo's shapes, float16: bench/aligner.py).
# PART 4: the default with calls not sized (the schedule's own A/B) at 1 / 16 / 64, then with the encoder pass
#   eager (engine.flow_encoder_graphs=false: the encoder graphs' A/B beside PART 1's default).
# PART 6: the hop alone (bench.gpu.paged_hops, fp16, 1 / 16 streams: the encoder pass graphed vs eager and their
#   mu's |diff|), then the LM's step budget (issue 51 item 3): default.toml at 64 streams with
#   vllm.max_num_batched_tokens 2048 and 16384 (the shipped 4096 is PART 1's row).
# PART 5: the field's client (vLLM-Omni's `vllm bench serve --omni`) against `python app.py` at 1 / 16 / 64, in its
#   terms (bench/gpu/omni.sh). Its own call, carrying .carry2 (`bash bench/gpu/omni.sh prepare`) instead of .carry1:
#   only on a machine where an earlier PART installed vLLM less than 30 s before.
# Knobs: RPS (2 requests per stream), FIXED (250 tokens), T (seconds per sweep, 240).
set -uo pipefail
cd "$(dirname "$0")/../.."
ME=bench/gpu/run.sh
sweep() {  # sweep TAG CONC [CONFIG] [SETS]: one in-process sweep, saved voice, as run.sh's serve step runs it
  echo "=== $1 (conc $2${3:+, $3}${4:+, $4})"
  env TAG="$1" CONC="$2" CONFIG="${3:-}" SETS="${4:-}" PREFLIGHT=0 VOICE=saved RPS="${RPS:-2}" WARMUP=1 \
    FIXED="${FIXED:-250}" SWEEP_TIMEOUT="${T:-240}" bash "$ME" serve 2>&1 | grep -E "^(BENCH|CAPACITY|\||NVIDIA)|Error|Traceback"
}
long() {  # long TAG [CONFIG] [SETS]: one 1,500-token segment, one stream
  echo "Hello." > /tmp/one_segment.txt
  env TAG="$1" CONC=1 CONFIG="${2:-}" SETS="${3:-}" PREFLIGHT=0 VOICE=saved RPS=2 WARMUP=0 FIXED=1500 \
    TEXTS=/tmp/one_segment.txt SWEEP_TIMEOUT="${T:-200}" bash "$ME" serve 2>&1 | grep -E "^(BENCH|\|)|Error|Traceback"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case ${1:-} in
  1) sweep default 1,16,64
     sweep resolve16 1,16,64 "" "engine.flow_incremental=false" ;;
  2) T=270 sweep capacity 16,32,48,64,96,128 "" "vllm.max_num_seqs=128 vllm.kv_cache_gib=3.5"
     sweep fast 1,16,64 configs/fast.toml ;;
  3) sweep exact 1,16,64 configs/exact.toml
     T=150 long long_default
     python -m bench aligner --device cuda --out "${OUT:-out}/aligner_cuda.json" 2>&1 | grep -E "^(\||\{)|Error|Traceback" ;;
  4) sweep unsized 1,16,64 "" "engine.first_call_ms=0 engine.max_call_ms=0"
     sweep eagerencoder 1,16,64 "" "engine.flow_encoder_graphs=false" ;;
  5) CONC="1 16 64" bash bench/gpu/omni.sh run ;;
  6) timeout 150 python -m bench.gpu.paged_hops "${OUT:-out}/paged_hops.json" --streams 1,16 --dtypes float16 2>&1 \
       | grep -E "^\{|Error|Traceback" | cut -c1-900
     T=200 sweep batched2048 64 "" "vllm.max_num_batched_tokens=2048"
     T=200 sweep batched16384 64 "" "vllm.max_num_batched_tokens=16384" ;;
  *) echo "usage: bash $0 1|2|3|4|5|6" >&2; exit 2 ;;
esac
ls "${OUT:-out}"
