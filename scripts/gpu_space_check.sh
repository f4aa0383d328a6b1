#!/usr/bin/env bash
# On the lent H200 (issue 18): the checkout started as a Space starts it -- `python app.py` with
# SYSTEM=spaces, the project not installed and not on PYTHONPATH (only the carried wheels are), vLLM's
# plugins switched to a name that is not ours -- serves /v1 synthesis through vLLM on the GPU.
#   run(carry=[".carry1"], command="bash .carry1/install_vllm.sh")
#   run(carry=[".carry2", ".wheels_extra"], command="bash .carry2/install_vllm.sh >/dev/null && bash scripts/gpu_space_check.sh")
set -uo pipefail
. scripts/gpu_env.sh || exit 3
. scripts/gpu_install_extra.sh || exit 3
[ -f /tmp/full/llm.pt ] || python3 -m app.tools.make_model /tmp/full --size full --force > "$OUT/make_full.json" 2>&1 \
  || { tail -20 "$OUT/make_full.json"; exit 4; }
t0=$(date +%s)
env PYTHONPATH=/tmp/site SYSTEM=spaces VLLM_PLUGINS=someone_elses_plugin COSYVOICE_MODEL_DIR=/tmp/full \
  timeout 400 python3 app.py > "$OUT/space_app.log" 2>&1 &
pid=$!
ready=0
for _ in $(seq 1 200); do
  if curl -sf localhost:7860/health 2>/dev/null | python3 -c 'import json,sys; sys.exit(0 if json.load(sys.stdin)["ready"] else 1)'; then ready=1; break; fi
  kill -0 $pid 2>/dev/null || break
  sleep 2
done
echo "ready=$ready after $(( $(date +%s) - t0 )) s"
if [ $ready = 1 ]; then
  curl -s localhost:7860/v1/voices -F audio=@assets/prompt_en.wav -F name=fox -F overwrite=true \
    -F transcript="The quick brown fox jumps over the lazy dog near the quiet river bank." | head -c 300; echo
  curl -s -D "$OUT/space_headers.txt" localhost:7860/v1/audio/speech -H 'Content-Type: application/json' \
    -d '{"model":"cosyvoice2","input":"Hello there, how are you today?","voice":"fox","response_format":"pcm","seed":1}' \
    -o "$OUT/space_hello.pcm"
  echo "pcm bytes: $(stat -c %s "$OUT/space_hello.pcm")"; grep -i "x-ttfa-ms\|x-request-id" "$OUT/space_headers.txt"
  curl -s localhost:7860/health | python3 -c 'import json,sys; h=json.load(sys.stdin); f=h["facts"]; print({k: f.get(k) for k in ("backend","vllm","model_path","device","sampler")}, h["status"])'
  curl -s localhost:7860/ | grep -o "<title>[^<]*</title>" | head -1
fi
grep -iE "architecture|Resolved|plugin" "$OUT/space_app.log" | head -5
kill $pid 2>/dev/null; wait $pid 2>/dev/null
rm -f "$OUT/space_hello.pcm"
