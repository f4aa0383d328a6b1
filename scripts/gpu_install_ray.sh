#!/usr/bin/env bash
# Sourced on the lent H200 after scripts/gpu_env.sh: installs the Ray Serve carried in .carry3/ (made here by
# scripts/pack_ray_carry.sh) into /tmp/site. Wheels of a distribution the machine already has are skipped, so
# the image's and vLLM's own versions win -- except grpcio: the image's 1.84.0 is older than the 1.85.1 that
# grpcio-reflection's generated code (imported by ray.serve) demands, so the carried 1.85.3 goes on top.
# Then `import ray.serve` must work.
[ -d .carry3 ] || { echo "no .carry3 folder was carried (bash scripts/pack_ray_carry.sh here)" >&2; return 3; }
python3 scripts/install_missing_wheels.py .carry3/wheels --always grpcio --label "ray dependencies installed" || return 4
[ -d /tmp/site/ray ] || tar xJf .carry3/ray_pruned.tar.xz -C /tmp/site || return 5
python3 -c "import ray, ray.serve; print('ray', ray.__version__)" || return 6
