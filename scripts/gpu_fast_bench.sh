#!/usr/bin/env bash
# On the lent H200: the flow's speed options (scripts/gpu_flow_options.py: precision, batched graphs,
# a small first hop, each with its deviation), then the whole-pipeline sweep of STAGE's config.
#   run(carry=[".carry1"], command="bash .carry1/install_vllm.sh")
#   run(carry=[".carry2", ".wheels_extra"], command="bash .carry2/install_vllm.sh >/dev/null && STAGE=defaults bash scripts/gpu_fast_bench.sh")
#   run(command="STAGE=fast bash scripts/gpu_fast_bench.sh")   (the same warm machine)
# STAGE: options (the flow check only) | defaults (options, then the default config's sweep) |
#   fast (configs/fast.toml's sweep; HOP_CHECK=1 first measures the first hop's deviation). Knobs as scripts/gpu_serve_bench.sh (CONC, RPS, VOICE, SETS).
set -uo pipefail
. scripts/gpu_env.sh || exit 3
. scripts/gpu_install_extra.sh || exit 3
[ -f /tmp/full/llm.pt ] || python3 -m app.tools.make_model /tmp/full --size full --force > "$OUT/make_full.json" 2>&1 \
  || { tail -20 "$OUT/make_full.json"; exit 4; }
case "${STAGE:-defaults}" in
  options|defaults)
    timeout 240 python3 scripts/gpu_flow_options.py /tmp/full "$OUT/flow_options.json" 2>&1 | grep -v Warning | tail -25
    [ "${STAGE:-defaults}" = options ] && exit 0
    TAG=defaults PREFLIGHT=0 VOICE=${VOICE:-saved} RPS=${RPS:-2} SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-300} \
      bash scripts/gpu_serve_bench.sh ;;
  fast)
    [ "${HOP_CHECK:-0}" = 1 ] && SKIP_PRECISION=1 timeout 120 python3 scripts/gpu_flow_options.py /tmp/full \
      "$OUT/flow_first_hop.json" 2>&1 | grep -v Warning | tail -3
    TAG=fast CONFIG=configs/fast.toml PREFLIGHT=0 VOICE=${VOICE:-saved,new} RPS=${RPS:-2} \
      SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-540} bash scripts/gpu_serve_bench.sh ;;
  *) echo "STAGE must be options, defaults or fast" >&2; exit 2 ;;
esac
