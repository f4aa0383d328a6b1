#!/usr/bin/env bash
# Browser-test prerequisites (tests/test_browser.py): Debian's chromium, ffmpeg (Gradio encodes
# streamed audio with it), nginx (tests/test_proxy.py), Prometheus' promtool (tests/test_prometheus.py) and the
# `playwright` Python package in .venv. Idempotent; needs root for
# apt-get (CI and this machine kind run as root). NEVER `playwright install`: that downloads a
# browser build of its own, which fails offline; the test drives /usr/bin/chromium instead.
# Use: bash scripts/setup_browser.sh   (after scripts/setup_cpu.sh made .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
command -v chromium >/dev/null || missing+=(chromium)
command -v ffmpeg >/dev/null || missing+=(ffmpeg)
[ -x /usr/sbin/nginx ] || missing+=(nginx-light)  # tests/test_proxy.py: the studio behind a reverse proxy
command -v promtool >/dev/null || missing+=(prometheus)  # tests/test_prometheus.py: promtool checks the dashboard's PromQL
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
. .venv/bin/activate
# requirements-dev.txt pins it; this covers a .venv made before the pin was added
python -c "import playwright" 2>/dev/null || python -m pip install -q "$(grep -E '^playwright' requirements-dev.txt)"
chromium --version
python -c "import importlib.metadata as m; print('playwright', m.version('playwright'), '(driving /usr/bin/chromium)')"
