#!/usr/bin/env bash
# The tests: the studio's setup plus the test tools (requirements-dev.txt, Ray Serve, Debian's chromium,
# ffmpeg, nginx and promtool through apt, the .venv-quant AWQ venv, the .venv-agents pipecat venv; no service
# left enabled or running), then `ruff check .` and pytest with the 25 slowest tests listed. Quick once set up;
# DRY_RUN=1 prints the plan.
# Use: bash scripts/test.sh [pytest arguments, e.g. tests/test_config.py -k name]
cd "$(dirname "$0")/.."
. scripts/lib.sh
setup_studio
setup_test_tools
dry || . .venv/bin/activate  # the tests' subprocesses (app.py, ray, playwright's driver) use this venv
run ruff check .
run python -m pytest -q --durations=25 "$@"
