#!/usr/bin/env bash
# The field's own client: vLLM-Omni's TTS serving benchmark (`vllm bench serve --omni --backend
# openai-audio-speech`, vllm-omni 0.26.0 beside vLLM 0.26.0), unchanged, against `python app.py` over HTTP with a
# saved voice, so first audio, RTF and continuity are stated in its terms (issue 51 item 4). Its code is never
# committed: `prepare` fetches it, with the page's extra wheels, into a git-ignored folder carried on its own.
#
#   bash bench/gpu/omni.sh prepare    here, with network: -> $CARRY (.carry2: wheels_extra/ and omni/, ~50 MB)
#   bash bench/gpu/omni.sh run        there, after `bash bench/gpu/run.sh install` on the same machine
#
# Knobs: CONC (1,16,64: closed-loop concurrency; 2 requests per stream, at least 4), FIXED (250 speech tokens
# per request, as the in-process sweep), CONFIG (a config file, default configs/default.toml), SETS ("k=v ...").
set -uo pipefail
cd "$(dirname "$0")/../.."
CARRY=${CARRY:-.carry2}
URL=http://127.0.0.1:7860
W=/tmp/omni

prepare() {  # vllm-omni 0.26.0's client modules (the wheel unpacked, its serving stack left out) + prettytable
  rm -rf "$CARRY/omni" && mkdir -p "$CARRY/omni/dl" || return 1
  EXTRA_WHEELS="$CARRY/wheels_extra" bash bench/gpu/run.sh extra-wheels || return 2
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d "$CARRY/omni/dl" vllm-omni==0.26.0 prettytable==3.19.0 wcwidth==0.9.5 || return 3
  local site="$CARRY/omni/site" whl
  for whl in "$CARRY"/omni/dl/prettytable-*.whl "$CARRY"/omni/dl/wcwidth-*.whl; do
    python3 -m zipfile -e "$whl" "$site" || return 4
  done
  python3 -m zipfile -e "$CARRY"/omni/dl/vllm_omni-0.26.0-*.whl "$CARRY/omni/wheel" || return 4
  mkdir -p "$site/vllm_omni/entrypoints/cli"
  cp -r "$CARRY/omni/wheel/vllm_omni/benchmarks" "$CARRY/omni/wheel/vllm_omni/metrics" "$site/vllm_omni/"
  cp -r "$CARRY/omni/wheel/vllm_omni/entrypoints/cli/benchmark" "$site/vllm_omni/entrypoints/cli/"
  cp "$CARRY/omni/wheel/vllm_omni/__init__.py" "$site/vllm_omni/"  # found by the client's stand-ins, never run
  rm -rf "$CARRY/omni/dl" "$CARRY/omni/wheel"
  du -sh "$CARRY"/*
}

health() { python3 -c "import httpx; r=httpx.get('$URL/health', timeout=5); print(r.status_code)" 2>/dev/null; }

run() {
  [ -f /tmp/vllm_env.sh ] || { echo "vLLM is not installed here: bash bench/gpu/run.sh install first" >&2; return 3; }
  . /tmp/vllm_env.sh
  export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE=1
  local out=${OUT:-out}/omni sets=(--set model.download=false --set server.concurrency_limit=128
    --set "server.voices_dir=\"$W/voices\"" --set "vllm.export_cache_dir=\"$W/vllm\"") kv n c pid voice
  mkdir -p "$out" "$W"
  python3 bench/gpu/install_wheels.py "$CARRY/wheels_extra" --label "extra wheels installed" || return 4
  [ -f /tmp/full/llm.pt ] || python3 -m app.tools.make_model /tmp/full --size full --force > "$out/make_full.json" || return 4
  for kv in ${SETS:-}; do sets+=(--set "$kv"); done
  setsid nohup python3 app.py --config "${CONFIG:-configs/default.toml}" --model-dir /tmp/full --host 127.0.0.1 \
    --port 7860 "${sets[@]}" > "$W/app.log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do [ "$(health)" = 200 ] && break; sleep 1; done  # a start-up wait in a script
  [ "$(health)" = 200 ] || { tail -30 "$W/app.log"; kill -- -"$pid"; return 5; }
  echo "server ready after ${SECONDS} s"
  voice=$(python3 -c "import httpx; from bench.soak import voice_upload; name, parts = voice_upload('omni')
r = httpx.post('$URL/v1/voices', timeout=120, **parts); r.raise_for_status(); print(name)") || return 6
  python3 -c "import json; from bench.__main__ import TEXTS
open('$W/texts.jsonl','w').writelines(json.dumps({'prompt': t}) + '\n' for t in TEXTS)"
  for c in ${CONC:-1 16 64}; do
    n=$((2 * c < 4 ? 4 : 2 * c))
    echo "=== vllm bench serve --omni, concurrency $c, $n requests"
    timeout 240 env PYTHONPATH="$CARRY/omni/site:$PYTHONPATH" python3 bench/gpu/omni_client.py --omni \
      --backend openai-audio-speech --base-url $URL --endpoint /v1/audio/speech --model FunAudioLLM/CosyVoice2-0.5B \
      --tokenizer /tmp/full/CosyVoice-BlankEN --dataset-name custom --dataset-path "$W/texts.jsonl" \
      --skip-chat-template --custom-output-len 1 --num-prompts "$n" --max-concurrency "$c" --request-rate inf \
      --num-warmups 1 --extra-body "{\"voice\": \"$voice\", \"fixed_tokens\": ${FIXED:-250}, \"seed\": 1}" \
      --percentile-metrics e2el,audio_ttfp,audio_rtf,audio_underrun --metric-percentiles 50,95 \
      --save-result --result-dir "$out" --result-filename "omni_c$c.json" 2>&1 \
      | sed -n '/Serving Benchmark Result/,$p'
  done
  kill -- -"$pid" 2>/dev/null
  grep -v -E "^(INFO|DEBUG)|^\((EngineCore|MainProcess|APIServer)" "$W/app.log" | tail -30 > "$out/app_tail.log"
}

case ${1:-} in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: bash $0 prepare|run" >&2; exit 2 ;;
esac
