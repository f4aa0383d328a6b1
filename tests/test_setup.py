"""The README's two commands as plans (scripts/studio.sh, scripts/test.sh with DRY_RUN=1: every command that would
change something, printed, nothing run) in a copy that has no venv yet, as a fresh clone: where torch's CPU
build comes from, and what happens to the services of Debian's test tools."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCH_CPU = "torch==2.13.0+cpu"
PYTORCH_CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"
# pip settings that name no package source: kept when the sources are hidden (the certificate reaches PyPI)
NOT_SOURCES = ("PIP_CERT", "PIP_DEFAULT_TIMEOUT", "PIP_DISABLE_PIP_VERSION_CHECK")


def fresh_copy(dest: Path) -> Path:
    """The files the setup reads (scripts, requirement files), without .venv, .venv-quant or .venv-agents."""
    shutil.copytree(REPO / "scripts", dest / "scripts")
    for req in REPO.glob("requirements*.txt"):
        shutil.copy(req, dest / req.name)
    return dest


def plan(dest: Path, env: dict[str, str], script: str = "scripts/test.sh") -> list[str]:
    """The commands `script` would run there ("+ ..." lines)."""
    done = subprocess.run(["bash", script], cwd=fresh_copy(dest), capture_output=True, text=True, timeout=180,
                          env={**env, "DRY_RUN": "1", "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout + done.stderr
    return [ln for ln in done.stdout.splitlines() if ln.startswith("+ ")]


def pip_sources_hidden() -> dict[str, str]:
    """This environment as a machine with pip's defaults would have it: no pip.conf, no PIP_* source (PyPI only)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in NOT_SOURCES}
    return {**env, "PIP_CONFIG_FILE": os.devnull}  # os.devnull: pip then reads no configuration file at all


def sources_have_torch_cpu() -> bool:
    """What the configured sources offer, asked as the setup asks (resolving torch alone, installing nothing)."""
    return subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-deps",
                           "--ignore-installed", TORCH_CPU], capture_output=True, timeout=120).returncode == 0


def test_torch_cpu_from_pytorch_index_only_where_the_sources_lack_it(tmp_path):
    """With pip's local sources hidden (PyPI has no +cpu build), the plan takes torch from PyTorch's CPU index, in
    both venvs, and is otherwise the same command for command; with the sources configured here it names that
    index only if they lack the build."""
    configured = plan(tmp_path / "configured", dict(os.environ))
    hidden = plan(tmp_path / "hidden", pip_sources_hidden())
    torch_steps = [ln for ln in hidden if ln.endswith(TORCH_CPU)]
    assert len(torch_steps) == 2, hidden  # .venv and .venv-quant
    assert all(PYTORCH_CPU_INDEX in ln for ln in torch_steps), torch_steps
    assert sum(PYTORCH_CPU_INDEX in ln for ln in hidden) == 2, hidden  # only torch comes from there
    assert [ln.replace(f" {PYTORCH_CPU_INDEX}", "") for ln in hidden] == [
        ln.replace(f" {PYTORCH_CPU_INDEX}", "") for ln in configured]
    assert any(PYTORCH_CPU_INDEX in ln for ln in configured) == (not sources_have_torch_cpu())
    assert configured[-2:] == ["+ ruff check .", "+ python -m pytest -q --durations=25"]
    # pipecat's pins would move .venv's soundfile and protobuf: its requirements go to .venv-agents only
    assert [ln for ln in configured if "requirements-agents" in ln] == [
        "+ .venv-agents/bin/python -m pip install -q -r requirements-agents.txt"], configured


def test_studio_command_installs_only_the_studio(tmp_path):
    """The studio's plan: its venv and requirements-cpu.txt, then app.py; no apt, no test tools, no second venv."""
    steps = plan(tmp_path, dict(os.environ), "scripts/studio.sh")
    assert steps[-1].startswith("+ .venv/bin/python app.py")
    others = ("apt-get", "systemctl", "requirements-dev", "requirements-ray", ".venv-quant", ".venv-agents")
    assert not [ln for ln in steps if any(w in ln for w in others)], steps


def fake_systemctl(bin_dir: Path, enabled: set[str], active: set[str]) -> dict[str, str]:
    """PATH with a `systemctl` that reports these units enabled / active (and records nothing else)."""
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(
        "#!/bin/sh\ncase \"$1\" in\n"
        f"  is-enabled) for u in {' '.join(enabled) or '-'}; do [ \"$3\" = \"$u\" ] && exit 0; done; exit 1 ;;\n"
        f"  is-active) for u in {' '.join(active) or '-'}; do [ \"$3\" = \"$u\" ] && exit 0; done; exit 3 ;;\n"
        "esac\nexit 0\n")
    (bin_dir / "systemctl").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "DRY_RUN": "1"}


def test_services_of_the_test_tools_are_disabled_not_left_enabled(tmp_path):
    """Debian's packages enable nginx and prometheus at install: the setup disables an enabled unit that nothing
    runs, and leaves one that runs (someone else started it) as it is, saying so."""
    env = fake_systemctl(tmp_path / "bin", enabled={"nginx", "prometheus"}, active={"prometheus"})
    done = subprocess.run(["bash", "-c", ". scripts/lib.sh && quiet_services nginx prometheus"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(ln.startswith("+ ") and ln.endswith("systemctl disable --quiet nginx") for ln in lines), lines
    assert not any("disable --quiet prometheus" in ln for ln in lines), lines
    assert any("prometheus.service runs" in ln for ln in lines), lines
