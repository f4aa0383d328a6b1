#!/usr/bin/env bash
# On the lent H200: the issue-6 soak of the whole app (`python app.py`, `full` random model) and the
# engine-kill drill. Two phases, because the soak (10 min) and the server start do not fit in one
# 10-minute command; the server and the soak run in their own sessions (setsid) and outlive the first.
#   run(carry=[".carry1"]); run(carry=[".carry2", ".wheels_extra"], command="bash .carry2/install_vllm.sh && bash scripts/gpu_soak.sh start")
#   run(command="bash scripts/gpu_soak.sh finish")     # within 30 s of the previous reply (the machine stays warm)
# Knobs (env): STREAMS (64), MINUTES (10), RATE (disconnect rate, 0.3), SETS ("k=v ..." config overrides).
set -uo pipefail
. scripts/gpu_env.sh || exit 3
W=/tmp/soak
export GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE=1
URL=http://127.0.0.1:7860
mkdir -p "$W"
health() { python3 -c "import httpx,sys; r=httpx.get('$URL/health', timeout=5); print(r.status_code, r.text[:400])" 2>&1; }
case "${1:-}" in
start)
  . scripts/gpu_install_extra.sh || exit 3
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
  [ -f /tmp/full/llm.pt ] || python3 -m app.tools.make_model /tmp/full --size full --force > "$W/make_full.log" 2>&1 \
    || { tail -20 "$W/make_full.log"; exit 4; }
  sets=(--set model.download=false --set server.concurrency_limit=64 --set "server.voices_dir=\"$W/voices\""
        --set "vllm.export_cache_dir=\"$W/vllm\"")
  for kv in ${SETS:-}; do sets+=(--set "$kv"); done
  setsid nohup python3 app.py --model-dir /tmp/full --host 127.0.0.1 --port 7860 "${sets[@]}" > "$W/app.log" 2>&1 &
  for _ in $(seq 300); do
    health | grep -q '^200' && break
    sleep 1
  done
  health
  health | grep -q '^200' || { tail -40 "$W/app.log"; exit 5; }
  echo "server ready after ${SECONDS} s"
  setsid nohup bash -c "python3 -m bench.soak --url $URL --streams ${STREAMS:-64} --minutes ${MINUTES:-10} \
    --disconnect-rate ${RATE:-0.3} --out $W/soak.json > $W/soak.log 2>&1; echo \$? > $W/soak.rc" > /dev/null 2>&1 &
  sleep 20
  health
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
  ;;
finish)
  for _ in $(seq "${WAIT_S:-560}"); do
    [ -f "$W/soak.rc" ] && break
    sleep 1
  done
  [ -f "$W/soak.rc" ] || { echo "the soak is still running: run finish again"; health; tail -3 "$W/soak.log"; exit 6; }
  echo "soak exit status $(cat "$W/soak.rc")"
  python3 -c "import json; r=json.load(open('$W/soak.json')); r.pop('samples'); print(json.dumps(r, indent=1))"
  timeout 400 python3 -m bench.engine_kill --url "$URL" --out "$W/engine_kill.json"
  health
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
  cp "$W/soak.json" "$W/engine_kill.json" "$OUT/" 2>/dev/null
  grep -v -E "^(INFO|DEBUG)|^\((EngineCore|MainProcess|APIServer)" "$W/app.log" | tail -60 > "$OUT/app_tail.log"
  ;;
*) echo "usage: $0 start|finish" >&2; exit 2 ;;
esac
