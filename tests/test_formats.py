"""Response formats of /v1/audio/speech (mp3, opus, aac, flac beside wav and pcm) end to end: `python app.py`
(tiny model, real vLLM CPU engine) asked by the official `openai` SDK, every answer decoded by FFmpeg's
decoders (PyAV) and compared with the wav of the same seeded request; plus the encoders alone.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from studio import save_voice

from app import audio_formats
from app.audio import OUTPUT_SAMPLE_RATE_HZ

TEXT = "Hello there, how are you today? The weather is lovely."
SEED = 11
# decoded length - wav length, in samples at 24 kHz: lossy streams keep the encoder's priming and pad
# their last frame (no gapless header in a stream). mp3: LAME's 576 + 529 delay + one 576-sample MPEG-2
# frame; aac: 1024 priming + one 1024 frame; opus: its pre-skip is signalled (exact), at most one 20 ms
# frame; flac: lossless and exact.
LENGTH_SLACK = {"mp3": 576 + 529 + 576, "aac": 1024 + 1024, "opus": 480, "flac": 0}
# decoded RMS / wav RMS over the take, measured on the tiny model's noise-like take (seed 11; the encoders
# are deterministic): mp3 0.929 (64 kbit/s MPEG-2 cuts the top band), aac 0.975, opus 0.996, flac 1.0
RMS_REL_TOL = 0.1


def decode(data: bytes) -> tuple[np.ndarray, int]:
    """FFmpeg's decoder (PyAV) -> (float32 [N] mono, sample rate)."""
    import av

    with av.open(io.BytesIO(data)) as c:
        frames = [f for f in c.decode(c.streams.audio[0])]
    rate = frames[0].sample_rate
    parts = []
    for f in frames:
        arr = f.to_ndarray().astype(np.float32)
        if f.format.name.startswith("s16"):
            arr /= 32768.0
        parts.append(arr.reshape(-1))
    return np.concatenate(parts), rate


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


def test_encoders_stream_from_the_first_block():
    """Every encoder gives bytes for the first block handed to it (no holding back a page or a buffer)."""
    t = np.arange(OUTPUT_SAMPLE_RATE_HZ * 3) / OUTPUT_SAMPLE_RATE_HZ
    pcm = (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype(np.int16)
    block = OUTPUT_SAMPLE_RATE_HZ // 2  # 0.5 s, half the engine's first chunk
    for fmt in audio_formats.ENCODED:
        enc = audio_formats.make_encoder(fmt)
        pieces = [enc.encode(pcm[i:i + block]) for i in range(0, pcm.size, block)] + [enc.finish()]
        enc.close()
        assert pieces[0] and all(pieces[1:-1]), (fmt, [len(p) for p in pieces])
        audio, rate = decode(b"".join(pieces))
        n = audio.size * OUTPUT_SAMPLE_RATE_HZ // rate
        assert 0 <= n - pcm.size <= LENGTH_SLACK[fmt] * max(1, rate // OUTPUT_SAMPLE_RATE_HZ), (fmt, n)


def test_whole_files_state_their_length():
    """encode_whole: exact lengths in the header (WAV sizes, FLAC STREAMINFO total), read back by soundfile and
    ffmpeg; a streamed FLAC's STREAMINFO says "unknown" (0), which libsndfile 1.2.2 cannot read: never sent."""
    t = np.arange(OUTPUT_SAMPLE_RATE_HZ * 2 + 7) / OUTPUT_SAMPLE_RATE_HZ
    pcm = (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype(np.int16)
    for fmt in audio_formats.FORMATS:
        data = audio_formats.encode_whole(pcm, fmt)
        if fmt == "flac":
            assert flac_total_samples(data) == pcm.size
        if fmt in ("wav", "pcm", "flac"):
            np.testing.assert_array_equal(read_with_ffmpeg(data, fmt), pcm, err_msg=fmt)
            np.testing.assert_array_equal(read_with_soundfile(data, fmt), pcm, err_msg=fmt)
    assert audio_formats.wav_header(pcm.size)[4:8] == (36 + 2 * pcm.size).to_bytes(4, "little")
    enc = audio_formats.make_encoder("flac")
    streamed = enc.encode(pcm) + enc.finish()
    assert flac_total_samples(streamed) == 0 and "flac" in audio_formats.WHOLE_ONLY


@pytest.fixture(scope="module")
def server(studio_cpu):
    """The shared `python app.py` on cpu.toml (conftest.py's studio_cpu)."""
    return studio_cpu[0]


@pytest.fixture(scope="module")
def oai(server):
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def voice(server):
    return save_voice(server, "fmt-voice")["id"]


def speak(oai, voice: str, fmt: str, **extra) -> tuple[bytes, dict[str, str], float, float]:
    """(body, headers, s to the first bytes, s to the end) of one streamed request in `fmt`."""
    t0 = time.perf_counter()
    pieces, first = [], None
    with oai.audio.speech.with_streaming_response.create(model="tts-1", voice=voice, input=TEXT, response_format=fmt,
                                                         extra_body={"seed": SEED, **extra}) as r:
        headers = dict(r.headers)
        for piece in r.iter_bytes():
            first = first or time.perf_counter()
            pieces.append(piece)
    return b"".join(pieces), headers, first - t0, time.perf_counter() - t0


def test_every_format_through_the_openai_sdk_matches_the_wav(oai, voice):
    wav_body, _, _, _ = speak(oai, voice, "wav")
    ref = np.frombuffer(wav_body[44:], dtype="<i2").astype(np.float32) / 32768.0
    assert ref.size > OUTPUT_SAMPLE_RATE_HZ // 2 and rms(ref) > 0
    again = np.frombuffer(speak(oai, voice, "pcm")[0], dtype="<i2").astype(np.float32) / 32768.0
    np.testing.assert_array_equal(again, ref)  # the seed fixes the take: each format encodes this same audio
    ratios = {}
    for fmt in audio_formats.ENCODED:
        body, headers, first_s, total_s = speak(oai, voice, fmt)
        assert headers["content-type"] == audio_formats.MEDIA_TYPES[fmt], (fmt, headers)
        if fmt in audio_formats.WHOLE_ONLY:  # sent whole, its length in its headers (test_every_format_...)
            assert headers.get("content-length") == str(len(body)), (fmt, headers)
        else:
            assert headers.get("transfer-encoding") == "chunked" and "content-length" not in headers, (fmt, headers)
            assert first_s < total_s, fmt
        assert headers["x-seed"] == str(SEED), fmt
        audio, rate = decode(body)
        if rate != OUTPUT_SAMPLE_RATE_HZ:  # Opus decoders give 48 kHz
            audio = audio[:: rate // OUTPUT_SAMPLE_RATE_HZ]
        extra = audio.size - ref.size
        assert 0 <= extra <= LENGTH_SLACK[fmt], (fmt, extra)
        if fmt == "flac":
            np.testing.assert_array_equal(audio[: ref.size], ref)  # lossless
        ratios[fmt] = rms(audio) / rms(ref)
    print("decoded RMS / wav RMS:", {k: round(v, 4) for k, v in ratios.items()})
    for fmt, ratio in ratios.items():
        assert abs(ratio - 1) <= RMS_REL_TOL, (fmt, ratios)


# libsndfile (soundfile) has no AAC decoder at all (1.2.2: "Format not recognised"); ffmpeg reads every format
NOT_FOR_SOUNDFILE = ("aac",)


def read_with_soundfile(data: bytes, fmt: str) -> np.ndarray:
    """soundfile.read, as a Python user would call it on the body -> int16 [N]."""
    import soundfile as sf

    raw = dict(format="RAW", subtype="PCM_16", samplerate=OUTPUT_SAMPLE_RATE_HZ, channels=1) if fmt == "pcm" else {}
    audio, rate = sf.read(io.BytesIO(data), dtype="int16", **raw)
    assert rate == OUTPUT_SAMPLE_RATE_HZ and audio.ndim == 1, (fmt, rate, audio.shape)
    return audio


def read_with_ffmpeg(data: bytes, fmt: str) -> np.ndarray:
    """The ffmpeg command line (Debian's), body on stdin -> int16 [N] at 24 kHz."""
    import subprocess

    raw = ["-f", "s16le", "-ar", str(OUTPUT_SAMPLE_RATE_HZ), "-ac", "1"] if fmt == "pcm" else []
    done = subprocess.run(["ffmpeg", "-v", "error", *raw, "-i", "pipe:0", "-f", "s16le", "-ar",
                           str(OUTPUT_SAMPLE_RATE_HZ), "-ac", "1", "pipe:1"], input=data, capture_output=True,
                          timeout=60)
    assert done.returncode == 0 and not done.stderr, (fmt, done.stderr[-500:])
    return np.frombuffer(done.stdout, dtype="<i2")


def flac_total_samples(data: bytes) -> int:
    """STREAMINFO's 36-bit total-samples field (bytes 18..25 of the file: rate, channels, bits, total)."""
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0, data[:8]  # the first metadata block is STREAMINFO
    return int.from_bytes(data[18:26], "big") & ((1 << 36) - 1)


@pytest.mark.parametrize("speed", [1.0, 0.5], ids=["streamed", "whole"])
def test_every_format_reads_with_soundfile_and_ffmpeg(server, voice, speed):
    """Every response format, streamed (speed 1) and whole (speed 0.5: made whole, then sent), as a user reads it:
    soundfile.read and the ffmpeg command line get the same take (lossless ones: the same samples as pcm).
    A whole response (and FLAC, always whole) states exact lengths: Content-Length, the WAV's RIFF and data
    sizes, FLAC's STREAMINFO total; a streamed one is chunked."""
    import struct

    def post(fmt: str) -> httpx.Response:
        body = {"model": "cosyvoice2", "voice": voice, "input": TEXT, "response_format": fmt, "speed": speed,
                "seed": SEED}
        r = httpx.post(server + "/v1/audio/speech", json=body, timeout=300)
        assert r.status_code == 200, (fmt, r.text)
        return r

    ref = np.frombuffer(post("pcm").content, dtype="<i2")
    assert ref.size > OUTPUT_SAMPLE_RATE_HZ // 2
    for fmt in audio_formats.FORMATS:
        r = post(fmt)
        data, whole = r.content, speed != 1.0 or fmt in audio_formats.WHOLE_ONLY
        if whole:
            assert r.headers.get("content-length") == str(len(data)), (fmt, r.headers)
        else:
            assert r.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.headers, fmt
        if fmt == "wav":
            riff, size = struct.unpack("<I", data[4:8])[0], struct.unpack("<I", data[40:44])[0]
            want = (len(data) - 8, ref.size * 2) if whole else (0xFFFFFFFF, 0xFFFFFFFF)
            assert (riff, size) == want, (riff, size, want)
        if fmt == "flac":
            assert flac_total_samples(data) == ref.size
        decoded = {"ffmpeg": read_with_ffmpeg(data, fmt)}
        if fmt not in NOT_FOR_SOUNDFILE:
            decoded["soundfile"] = read_with_soundfile(data, fmt)
        for reader, audio in decoded.items():
            extra = audio.size - ref.size
            assert 0 <= extra <= LENGTH_SLACK.get(fmt, 0) * 2, (fmt, reader, extra)  # opus: 48 kHz frames
            if fmt in ("wav", "pcm", "flac"):
                np.testing.assert_array_equal(audio[: ref.size], ref, err_msg=f"{fmt} {reader}")
            else:
                assert abs(rms(audio.astype(np.float32)) / rms(ref.astype(np.float32)) - 1) <= RMS_REL_TOL, (
                    fmt, reader)


def active_streams(server: str) -> float:
    """The server's `cosyvoice_active_streams` gauge, read from its Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(server + "/metrics", timeout=60).text)}
    return fams["cosyvoice_active_streams"].samples[0].value


def test_formats_stream_before_the_take_is_done(server, voice):
    """A long take (fixed_tokens: 12 s) in mp3: the first encoded bytes arrive while the engine still speaks.

    Checked by events, not by timing ratios (which a loaded 2-core box bends): when the first mp3 bytes
    are here the synthesis is still running on the server (its gauge counts it), and it ends after."""
    assert active_streams(server) == 0
    body = {"model": "cosyvoice2", "voice": voice, "input": TEXT, "response_format": "mp3", "fixed_tokens": 300}
    t0 = time.perf_counter()
    with httpx.stream("POST", server + "/v1/audio/speech", json=body, timeout=300) as r:
        assert r.status_code == 200 and r.headers["transfer-encoding"] == "chunked"
        pieces = r.iter_bytes()
        first = next(pieces)
        first_s = time.perf_counter() - t0
        during = active_streams(server)  # 11 s of the take are still to be made: ~1 s of work on the tiny model
        ttfa_ms = float(r.headers["x-ttfa-ms"])
        rest = b"".join(pieces)
    assert first and rest
    assert first_s * 1e3 >= ttfa_ms, (first_s, ttfa_ms)
    assert during == 1, "the first mp3 bytes came only after the synthesis had ended: the body was held back"
    audio, _ = decode(first + rest)
    assert audio.size >= 11 * OUTPUT_SAMPLE_RATE_HZ, audio.size  # the whole take came after that first piece


def test_a_whole_response_stops_being_made_when_its_client_leaves(server, voice):
    """FLAC is made whole before it is sent: a client that hangs up meanwhile (a raw socket, closed while the
    server's gauge shows the synthesis running) aborts it, counted `cancelled`, as a streamed one would be."""
    import json
    import socket
    from urllib.parse import urlsplit

    def cancelled() -> int:
        return httpx.get(server + "/health", timeout=60).json()["requests"]["outcomes"].get("cancelled", 0)

    assert active_streams(server) == 0
    before = cancelled()
    body = json.dumps({"model": "cosyvoice2", "voice": voice, "input": TEXT, "response_format": "flac",
                       "fixed_tokens": 1500}).encode()  # 60 s of audio: several seconds of work
    url = urlsplit(server)
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 120
        while active_streams(server) == 0:
            assert time.monotonic() < deadline, "the synthesis never started"
            time.sleep(0.05)
    deadline = time.monotonic() + 60  # closed: the synthesis ends, aborted (counted cancelled, not ok)
    while active_streams(server):
        assert time.monotonic() < deadline, "the synthesis went on after its client left"
        time.sleep(0.05)
    assert cancelled() == before + 1


def test_a_bad_format_gets_a_400_listing_the_accepted_ones(server, oai, voice):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        oai.audio.speech.create(model="tts-1", voice=voice, input=TEXT, response_format="ogg")
    err = e.value.response.json()["error"]
    assert err["param"] == "response_format", err
    for fmt in audio_formats.FORMATS:
        assert f"'{fmt}'" in err["message"], err
    schema = httpx.get(server + "/v1/openapi.json").json()
    ref = schema["paths"]["/v1/audio/speech"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = ref["$ref"].rsplit("/", 1)[-1]
    assert schema["components"]["schemas"][name]["properties"]["response_format"]["enum"] == list(audio_formats.FORMATS)
    content = schema["paths"]["/v1/audio/speech"]["post"]["responses"]["200"]["content"]
    assert set(audio_formats.MEDIA_TYPES.values()) <= set(content)


def test_page_converts_the_final_take(tmp_path):
    """The page's download choice: the final WAV as written by the page, converted to each format and decoded."""
    from app.audio import wav_bytes
    from app.ui.download import DOWNLOAD_FORMATS, convert_take

    t = np.arange(OUTPUT_SAMPLE_RATE_HZ * 2) / OUTPUT_SAMPLE_RATE_HZ
    wave = (0.3 * np.sin(2 * np.pi * 330 * t)).astype(np.float32)
    take = tmp_path / "take.wav"
    take.write_bytes(wav_bytes(wave, OUTPUT_SAMPLE_RATE_HZ))
    assert convert_take(None, "mp3") is None and convert_take(str(take), "wav") == str(take)
    for fmt in set(DOWNLOAD_FORMATS) - {"wav"}:
        out = convert_take(str(take), fmt)
        assert out.endswith(audio_formats.SUFFIXES[fmt]), out
        audio, rate = decode(Path(out).read_bytes())
        n = audio.size * OUTPUT_SAMPLE_RATE_HZ // rate
        assert 0 <= n - wave.size <= LENGTH_SLACK[fmt] * rate // OUTPUT_SAMPLE_RATE_HZ, (fmt, n)
        assert abs(rms(audio) / rms(wave) - 1) <= RMS_REL_TOL, fmt


def test_bench_formats_prints_and_writes_its_report(tmp_path):
    """`python -m bench formats`: one row per (format, library) pair, the chosen ones marked, JSON written."""
    import json
    import subprocess
    import sys

    out = tmp_path / "formats.json"
    done = subprocess.run([sys.executable, "-m", "bench", "formats", "--seconds", "3", "--repeats", "1",
                           "--out", str(out)], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| first_byte_ms |" in done.stdout.replace("| format | backend | chosen ", "|")
    rows = json.loads(out.read_text())["rows"]
    chosen = {r["format"]: r for r in rows if r["chosen"]}
    assert set(chosen) == set(audio_formats.ENCODED)
    for fmt, r in chosen.items():
        assert r["first_audio_block"] == 0 and r["first_byte_ms"] > 0 and r["encode_ms_per_audio_s"] > 0, (fmt, r)


def test_page_download_choice_in_chromium(server):
    """The page in headless Chromium: a take of the page's (low-latency) player, in the page's final WAV, then
    "Download as" mp3 and flac give files that decode to the final WAV's audio (flac: the same samples)."""
    import importlib.util

    from studio import EXAMPLE_TRANSCRIPT, EXAMPLE_WAV
    from test_browser import CHROMIUM, CHROMIUM_ARGS, _need

    _need(Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing")
    _need(importlib.util.find_spec("playwright") is not None, "the playwright package is missing")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
            page.goto(server)
            page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('ready')",
                                   timeout=60_000)
            page.locator("#prompt_audio input[type=file]").set_input_files(str(EXAMPLE_WAV))
            page.wait_for_selector("#prompt_audio audio, #prompt_audio [data-testid='waveform-prompt_audio']",
                                   state="attached", timeout=30_000)
            page.locator("#prompt_text textarea").fill(EXAMPLE_TRANSCRIPT)
            page.locator("#seed input").fill(str(SEED))
            page.locator("#text textarea").fill(TEXT)
            page.locator("#go").click()
            page.wait_for_selector("#final_out a[download]", timeout=180_000)
            wav_url = page.locator("#final_out a[download]").get_attribute("href")  # the page's own blob: URL
            wav = bytes(page.evaluate("async (u) => [...new Uint8Array(await (await fetch(u)).arrayBuffer())]",
                                      wav_url))
            ref = np.frombuffer(wav[44:], dtype="<i2").astype(np.float32) / 32768.0
            for fmt in ("mp3", "flac"):
                page.locator("#download_format input").click()
                page.get_by_role("option", name=fmt, exact=True).click()
                page.wait_for_timeout(1500)  # the conversion refreshes the button's file
                with page.expect_download(timeout=30_000) as got:
                    page.locator("#download_take").click()
                download = got.value
                assert download.suggested_filename.endswith(audio_formats.SUFFIXES[fmt]), download.suggested_filename
                audio, rate = decode(Path(download.path()).read_bytes())
                assert rate == OUTPUT_SAMPLE_RATE_HZ and 0 <= audio.size - ref.size <= LENGTH_SLACK[fmt], fmt
                if fmt == "flac":
                    np.testing.assert_array_equal(audio[:ref.size], ref)
        finally:
            browser.close()
