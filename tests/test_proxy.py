"""The studio behind a reverse proxy: Debian's nginx with its default response buffering, as a
self-hosted deployment puts it (Hugging Face Spaces also serves through a proxy), in front of
`python app.py` (tiny model, real vLLM CPU engine) with the page's login on.

Through the proxy: streamed PCM arrives as it is made with the same bytes as without it, the proxy
adds little to the first byte, and the page logs in, loads, uploads and plays with the low-latency
player exactly what the server sent (relative URLs, the login cookie through the proxy). The app
sends `X-Accel-Buffering: no` (nginx honours and strips it); a run without it streamed as well,
since nginx passes on each full buffer and our PCM chunks are ~50 KB: the header is for proxies and
chunk sizes where a held partial buffer would matter.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from studio import free_port, run_studio
from test_browser import CHROMIUM, CHROMIUM_ARGS, _need
from test_player import (
    CORES,
    LAST,
    LOGIN,
    PROMPT_TEXT,
    PROMPT_WAV,
    SCHEDULED_HOOK,
    check_scheduled_equals_received,
    open_studio,
    play_low_latency,
)

NGINX = "/usr/sbin/nginx"
SERVER_CORES = ",".join(map(str, CORES[0]))  # as tests/test_player.py: the server (and nginx) here, the client
# on the last core, or the server's compute starves the reading client (its own machine, in real use)
PROXY_ADDED_MS = 100  # median client first byte minus the server's arrival -> headers, through nginx
# several segments, so the audio streams for seconds (the check needs 500 ms between first and last byte); a third
# of test_player's LONG_TEXT: the 7 full generations took ~80 s of this 2-core box with its 12 sentences
TEXT = " ".join(["This long sentence keeps the model talking for quite a while."] * 4)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("proxied")
    sets = {"vllm.dtype": '"bfloat16"', "model.download": "false", "server.auth": json.dumps(":".join(LOGIN)),
            "vllm.cpu_omp_threads_bind": json.dumps(SERVER_CORES)}
    with run_studio(tiny_model_dir, tmp, sets, prefix=["taskset", "-c", SERVER_CORES]) as (url, _):
        yield url


@pytest.fixture(scope="module")
def proxy(server, tmp_path_factory):
    """Base URL of nginx (defaults: proxy_buffering on) proxying to the studio."""
    _need(Path(NGINX).is_file(), f"{NGINX} is missing")
    tmp = tmp_path_factory.mktemp("nginx")
    port = free_port()
    temp_paths = " ".join(f"{kind}_temp_path {tmp / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi",
                                                                         "scgi"))
    conf = tmp / "nginx.conf"
    conf.write_text(f"""{'user root;' if os.geteuid() == 0 else ''}
worker_processes 1;
pid {tmp / 'nginx.pid'};
error_log {tmp / 'error.log'};
events {{ worker_connections 256; }}
http {{
  access_log off;
  {temp_paths}
  client_max_body_size 30m;
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass {server};
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Host $http_host;
      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Proto $scheme;
    }}
  }}
}}
""")
    cmd = ["taskset", "-c", SERVER_CORES, NGINX, "-p", str(tmp), "-c", str(conf), "-g", "daemon off;"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, (tmp / "error.log").read_text()
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "nginx did not listen"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)


def timed_speech(url: str, text: str) -> tuple[bytes, dict, float, float]:
    """(PCM, headers, first-byte ms, last-byte ms) of one /studio/speech request with the login."""
    body = {"text": text, "prompt_audio": str(PROMPT_WAV), "prompt_text": PROMPT_TEXT, "seed": 3}
    t0 = time.perf_counter()
    first, parts = None, []
    with httpx.stream("POST", f"{url}/studio/speech", json=body, auth=LOGIN, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for piece in r.iter_raw():
            if first is None and piece:
                first = (time.perf_counter() - t0) * 1e3
            parts.append(piece)
    return b"".join(parts), dict(r.headers), first, (time.perf_counter() - t0) * 1e3


def test_streamed_audio_passes_through_a_buffering_proxy(server, proxy):
    """Same bytes, streamed; the client's first byte comes within PROXY_ADDED_MS of the moment the
    server sent its headers with the first chunk (X-Handler-Ms: request arrival -> headers)."""
    direct, headers, _, _ = timed_speech(server, TEXT)
    assert headers["x-accel-buffering"] == "no"  # nginx: do not hold this response back
    added = {"direct": [], "nginx": []}
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, CORES[1])  # this (client) thread on the client's core
    try:
        runs = [[timed_speech(url, TEXT) for url in (server, proxy)] for _ in range(3)]
    finally:
        os.sched_setaffinity(0, before)
    for pair in runs:
        for name, (pcm, got, first_ms, last_ms) in zip(("direct", "nginx"), pair, strict=True):
            assert pcm == direct  # same seed, same bytes; the proxy passes them untouched
            assert first_ms < last_ms - 500, (name, first_ms, last_ms)  # streamed as made, not at the end
            added[name].append(first_ms - float(got["x-handler-ms"]))
        assert "x-accel-buffering" not in got  # consumed by nginx
    print(f"\nclient first byte minus server arrival->headers, ms: "
          f"{ {k: [round(a) for a in v] for k, v in added.items()} }")
    assert statistics.median(added["nginx"]) <= PROXY_ADDED_MS, added
    assert httpx.get(f"{proxy}/health", timeout=10).json()["ready"]  # probes work through it too


def test_the_page_logs_in_and_plays_through_the_proxy(proxy):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = open_studio(browser, proxy, SCHEDULED_HOOK)  # login form, page load, upload: all through nginx
            run = play_low_latency(page)
            assert run["state"] == "done" and run["mode"] == "worklet" and run["underruns"] == 0, run
            received = check_scheduled_equals_received(page, run)
            assert received.size and np.abs(received).max() > 0
            t = {k: round(v - run["t"]["click"]) for k, v in run["t"].items() if v is not None}
            print(f"\nthrough nginx, low-latency: click→sound {t['firstSound']} ms, server TTFA "
                  f"{run['ttfa']:.0f} ms; timeline {t}")
            assert page.evaluate(f"{LAST}.requestId") == run["requestId"]
        finally:
            browser.close()
