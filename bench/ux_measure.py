"""Screenshots and idle/shutdown numbers of the studio page, as a user meets it (issue 17).

    python -m bench.ux_measure --label before   # -> out/screens/before/*.png, out/ux_measure_before.json

Starts `python app.py` on a tiny random model (the tests' command line, tests/studio.py) and headless
Debian Chromium (Playwright, executable_path; never `playwright install`), then:
  1. idle.png once the page is ready and the panels have ticked;
  2. idle cost over IDLE_S: CPU seconds of every Chromium process of this browser (utime+stime from
     /proc/<pid>/stat, renderers apart) and of the server's process tree, and the server log lines written;
  3. run.png after a default-player Generate, stop.png 2 s after Stop mid-stream with the standard
     player (whether any <audio> still plays, how many "Error" badges show), error.png after Generate
     with no text (the default player), plus the refusal of a text file named .wav at upload;
  4. shutdown with the tab still open: SIGTERM (or --signal INT) to the server; seconds from the signal to
     the exit of the whole process group, whether it had to be killed after SHUTDOWN_LIMIT_S, and the
     log's tracebacks and force-kill lines.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--autoplay-policy=no-user-gesture-required"]
IDLE_S = 30.0  # idle window (s)
SETTLE_S = 5.0  # after the page is ready, before the idle window
SHUTDOWN_LIMIT_S = 60.0  # then SIGKILL to the group (counted as a force-kill)
LONG_TEXT = " ".join(["This long sentence keeps the model talking for quite a while."] * 12)
TEXT = "Hello there, how are you today?"
CLK_TCK = os.sysconf("SC_CLK_TCK")  # /proc stat ticks per second
# "Error" badges Gradio draws on a component whose event failed
ERROR_BADGES = "() => [...document.querySelectorAll('.error, [data-testid=\"error\"]')]" \
               ".filter(e => e.offsetParent !== null && /error/i.test(e.innerText)).length"
PLAYING_AUDIO = "() => [...document.querySelectorAll('audio')].filter(a => !a.paused && !a.ended).length"


def proc_table() -> dict[int, tuple[int, float, str]]:
    """pid -> (ppid, cpu seconds, cmdline) of every process readable now."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        out[int(d.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK, cmd)
    return out


def descendants(table: dict[int, tuple[int, float, str]], root: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    seen, todo = set(), [root]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            if c not in seen:
                seen.add(c)
                todo.append(c)
    return seen


def cpu_split(server_pid: int) -> dict[str, float]:
    """CPU seconds now: chromium (all of this browser's processes), its renderers, the server tree."""
    t = proc_table()
    server = descendants(t, server_pid) | {server_pid}
    mine = descendants(t, os.getpid()) - server
    chrome = [p for p in mine if "chromium" in t[p][2]]
    return {"chromium_s": sum(t[p][1] for p in chrome),
            "renderer_s": sum(t[p][1] for p in chrome if "--type=renderer" in t[p][2]),
            "server_s": sum(t[p][1] for p in server if p in t)}


def wait_ready(base: str, proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).json()["ready"]:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"not ready in time:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)  # a script waiting on another process's startup, not a server loop


def shutdown(proc: subprocess.Popen, log: Path, sig: str) -> dict:
    """Signal the server; seconds until its whole process tree is gone (SIGKILL after SHUTDOWN_LIMIT_S)."""
    n_before = len(log.read_text().splitlines())
    tree = descendants(proc_table(), proc.pid)
    t_sig = time.monotonic()
    proc.send_signal(signal.SIGTERM if sig == "TERM" else signal.SIGINT)
    forced = False
    try:
        proc.wait(timeout=SHUTDOWN_LIMIT_S)
    except subprocess.TimeoutExpired:
        forced = True
    while not forced and any(Path(f"/proc/{p}").exists() for p in tree):  # the engine may outlive the app
        if time.monotonic() - t_sig > SHUTDOWN_LIMIT_S:
            forced = True
            break
        time.sleep(0.1)
    seconds = time.monotonic() - t_sig
    if forced:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    tail = log.read_text().splitlines()[n_before:]
    return {"signal": sig, "with_open_tab": True, "seconds": round(seconds, 2), "killed_by_script": forced,
            "exit_code": proc.returncode, "log_lines_after_signal": len(tail),
            "force_kill_lines": [ln for ln in tail if "kill" in ln.lower()][:5],
            "tracebacks_after_signal": sum("Traceback" in ln for ln in tail)}


def page_session(base: str, shots: Path, proc: subprocess.Popen, log: Path, result: dict, sig: str,
                 collapse_panels: bool = False) -> None:
    server_pid = proc.pid
    from playwright.sync_api import sync_playwright

    sys.path.insert(0, str(REPO / "tests"))
    from studio import EXAMPLE_TRANSCRIPT, EXAMPLE_WAV

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(base)
            page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('ready')",
                                   timeout=120_000)
            page.wait_for_timeout(SETTLE_S * 1000)
            page.screenshot(path=str(shots / "idle.png"), full_page=True)
            if collapse_panels:  # what the open panels cost: their accordion closed (its timer stops)
                page.get_by_text("Live engine panels", exact=True).click()
                page.wait_for_timeout(SETTLE_S * 1000)
            # idle cost
            lines0, cpu0, t0 = len(log.read_text().splitlines()), cpu_split(server_pid), time.monotonic()
            page.wait_for_timeout(IDLE_S * 1000)
            lines1, cpu1, dt = len(log.read_text().splitlines()), cpu_split(server_pid), time.monotonic() - t0
            result["idle"] = {"window_s": round(dt, 1), "server_log_lines": lines1 - lines0,
                              **{k.replace("_s", "_cpu_percent_of_core"): round(100 * (cpu1[k] - cpu0[k]) / dt, 1)
                                 for k in cpu0}}
            # a default-player run
            page.locator("#prompt_audio input[type=file]").set_input_files(str(EXAMPLE_WAV))
            page.wait_for_selector("#prompt_audio audio, #prompt_audio [data-testid='waveform-prompt_audio']",
                                   state="attached", timeout=30_000)
            page.locator("#prompt_text textarea").fill(EXAMPLE_TRANSCRIPT)
            page.locator("#text textarea").fill(TEXT)
            page.locator("#go").click()
            page.wait_for_function("() => window.studioPlayer?.last?.result || window.studioPlayer?.last?.error",
                                   timeout=180_000)
            page.wait_for_timeout(1000)
            page.screenshot(path=str(shots / "run.png"), full_page=True)
            # Stop mid-stream with the standard player
            page.locator("#player").get_by_label("standard (Gradio)").check()
            page.locator("#text textarea").fill(LONG_TEXT)
            page.locator("#go").click()
            page.wait_for_function("() => (document.querySelector('#stream_out audio')?.currentTime || 0) > 0",
                                   timeout=180_000)
            page.locator("#stop").click()
            page.wait_for_timeout(2000)
            link = page.locator("#final_out a[download]")
            result["stop"] = {"audio_playing_2s_after_stop": page.evaluate(PLAYING_AUDIO),
                              "error_badges": page.evaluate(ERROR_BADGES),
                              "stats": page.locator("#stats").inner_text()[:200],
                              "final_wav_download": link.get_attribute("download") if link.count() else None}
            page.screenshot(path=str(shots / "stop.png"), full_page=True)
            # an error with the default player: no text
            page.locator("#player").get_by_label("low-latency (WebAudio)").check()
            page.locator("#text textarea").fill("")
            page.locator("#go").click()
            page.wait_for_timeout(3000)
            page.screenshot(path=str(shots / "error.png"), full_page=True)
            near = page.locator("#studio_error")
            result["error"] = {"toasts": page.locator(".toast-body, #studio_toast:not([hidden])").count(),
                               "error_badges": page.evaluate(ERROR_BADGES),
                               "next_to_generate": near.inner_text() if near.count() else None}
            # a text file named .wav at upload
            fake = Path(tempfile.mkdtemp()) / "notes.wav"
            fake.write_text("this is not audio\n")
            page.locator("#prompt_audio button[aria-label='Clear']").click(timeout=5000)
            page.locator("#prompt_audio input[type=file]").set_input_files(str(fake))
            page.wait_for_timeout(3000)
            page.screenshot(path=str(shots / "upload_text_as_wav.png"), full_page=True)
            result["upload_text_as_wav"] = {"toasts": [t.inner_text() for t in page.locator(".toast-body").all()]}
            result["shutdown"] = shutdown(proc, log, sig)  # Ctrl+C with the tab still open
        finally:
            browser.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", required=True, help="before | after: out/screens/<label>/, out/ux_measure_<label>.json")
    ap.add_argument("--signal", choices=["TERM", "INT"], default="TERM")
    ap.add_argument("--collapse-panels", action="store_true", help="measure the idle tab with the panels closed")
    ap.add_argument("--model-dir", type=Path, help="a tiny model folder (default: made in a temp folder)")
    args = ap.parse_args()
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from studio import free_port, studio_command

    tmp = Path(tempfile.mkdtemp(prefix="ux_measure_"))
    model_dir = args.model_dir
    if model_dir is None:
        from app.model.random.make import make_model
        from app.model.random.sizes import TINY

        model_dir = tmp / "tiny"
        make_model(model_dir, TINY, seed=0)
    shots = REPO / "out" / "screens" / args.label
    shots.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp / "server.log"
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1",
           "GRADIO_TEMP_DIR": str(tmp / "gradio"), "PYTHONUNBUFFERED": "1"}
    cmd = studio_command(model_dir, tmp, port, {"vllm.dtype": '"bfloat16"', "model.download": "false"})
    result: dict = {"label": args.label, "panels_collapsed": args.collapse_panels,
                    "command": " ".join(sys.argv), "server_command": " ".join(cmd[1:]),
                    "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load_avg_start": os.getloadavg()}
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.monotonic()
        wait_ready(base, proc, log)
        result["ready_s"] = round(time.monotonic() - t0, 1)
        page_session(base, shots, proc, log, result, args.signal, args.collapse_panels)
    finally:
        if "shutdown" not in result:  # the page session failed before its shutdown
            result["shutdown"] = shutdown(proc, log, args.signal)
        text = log.read_text()
        result["log_tracebacks"] = text.count("Traceback (most recent call last)")
        result["log"] = str(log)
        out = REPO / "out" / f"ux_measure_{args.label}.json"
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
