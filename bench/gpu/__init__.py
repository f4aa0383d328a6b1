"""GPU checks and the offline-GPU recipes: `bash bench/gpu/run.sh help` (docs/gpu_runs.md)."""
