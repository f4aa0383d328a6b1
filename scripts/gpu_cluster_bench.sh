#!/usr/bin/env bash
# On the lent H200 (issue 19): the API on Ray Serve (`python -m app.cluster`) with one replica on the one GPU,
# swept over HTTP by the bench (`--url`, pcm, saved voice, fixed-length outputs). Reports land in $OUT as
# cluster<N>_<preset>.json, the cluster's log as cluster<N>_<preset>.log. Transfers when cold (each <= 64 MiB):
#   run(carry=[".carry1"], command="bash .carry1/install_vllm.sh")
#   run(carry=[".carry2", ".wheels_extra"], command="bash .carry2/install_vllm.sh >/dev/null && . scripts/gpu_env.sh && . scripts/gpu_install_extra.sh")
#   run(carry=[".carry3"], command=". scripts/gpu_env.sh && . scripts/gpu_install_ray.sh && PRESET=fast bash scripts/gpu_cluster_bench.sh")
# Knobs (env): PRESET (fast = configs/fast.toml | default), REPLICAS (1), CONC (1,16,64), RPS (2), FIXED (250).
set -uo pipefail
. scripts/gpu_env.sh || exit 3
python3 -c "import ray.serve" 2>/dev/null || { . scripts/gpu_install_ray.sh || exit 4; }
PRESET=${PRESET:-fast}; N=${REPLICAS:-1}; PORT=8000
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
[ -f /tmp/full/llm.pt ] || python3 -m app.tools.make_model /tmp/full --size full --force > "$OUT/make_full.json" 2>&1 \
  || { tail -20 "$OUT/make_full.json"; exit 5; }
cfg=(); [ "$PRESET" = fast ] && cfg=(--config configs/fast.toml)
# every stream of the sweep gets a slot (the bench measures the engine, not the refusals)
log="$OUT/cluster${N}_${PRESET}.log"
setsid python3 -m app.cluster --replicas "$N" --model-dir /tmp/full --port $PORT "${cfg[@]}" \
  --set server.concurrency_limit=64 --set server.queue_max_size=128 > "$log" 2>&1 &
pid=$!
trap 'kill -TERM -- -$pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
t0=$(date +%s)
get() { python3 -c "import sys,urllib.request as u;sys.stdout.write(u.urlopen(sys.argv[1],timeout=10).read().decode())" "$1"; }
until get "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; do  # 200 once every replica is ready, else 503
  kill -0 $pid 2>/dev/null || { echo "cluster exited"; tail -40 "$log"; exit 6; }
  [ $(( $(date +%s) - t0 )) -gt 300 ] && { echo "not ready after 300 s"; tail -40 "$log"; exit 7; }
  sleep 2  # a start-up wait in a script, not a request path
done
echo "ready after $(( $(date +%s) - t0 )) s"
get "http://127.0.0.1:$PORT/health" | head -c 1500; echo
timeout "${SWEEP_TIMEOUT:-420}" python3 -m bench sweep --url "http://127.0.0.1:$PORT" --conc "${CONC:-1,16,64}" \
  --fixed-tokens "${FIXED:-250}" --requests-per-stream "${RPS:-2}" --voice saved --warmup 1 \
  --out "$OUT/cluster${N}_${PRESET}.json" 2>&1 | grep -v -E "^(INFO|DEBUG)|WARNING" | tail -30
get "http://127.0.0.1:$PORT/metrics" | grep -E "^cosyvoice_cluster_|replica=" | head -20
