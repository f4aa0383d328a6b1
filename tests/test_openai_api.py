"""The /v1 HTTP API end to end: `python app.py` (tiny model, real vLLM CPU engine) driven by the official
`openai` SDK and httpx; plus the error shapes and auth in-process (FastAPI TestClient, no engine).

The server's HTTP slots are few on purpose (2 running, 1 waiting) so the busy test needs four requests.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from studio import save_voice

from app.audio import OUTPUT_SAMPLE_RATE_HZ, SAMPLES_PER_TOKEN

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = json.loads((REPO / "assets" / "examples.json").read_text(encoding="utf-8"))
EN_WAV, EN_TRANSCRIPT = REPO / "assets" / "prompt_en.wav", EXAMPLES["voices"][0]["transcript"]
TEXT = "Hello there, how are you today? The weather is lovely."


def error_of(r: httpx.Response) -> dict:
    """The OpenAI error object of a response (asserting the shape)."""
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    assert body["error"]["message"]
    return body["error"]


# --- in-process: shapes and auth without an engine ---------------------------------------------------


@pytest.fixture()
def app_not_ready(tmp_path):
    from fastapi.testclient import TestClient

    from app.config import load_config
    from app.server.main import build_server

    cfg = load_config(None, {"server.api_key": "s3cret", "server.voices_dir": str(tmp_path / "v"),
                             "model.dir": str(tmp_path / "missing")})
    app = build_server(cfg)  # the lifespan is not run: the service stays "waiting to start"
    return TestClient(app, raise_server_exceptions=False)


def test_auth_and_error_shapes_without_engine(app_not_ready):
    c = app_not_ready
    body = {"model": "cosyvoice2", "input": "hi", "voice": "x"}
    r = c.post("/v1/audio/speech", json=body)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert error_of(r)["type"] == "authentication_error"
    assert c.post("/v1/audio/speech", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    auth = {"Authorization": "Bearer s3cret"}
    r = c.post("/v1/audio/speech", json=body, headers=auth)
    assert r.status_code == 503 and r.headers["retry-after"] and error_of(r)["code"] == "not_ready"
    r = c.post("/v1/audio/speech", json={"model": "tts-1", "voice": "x"}, headers=auth)  # no input
    assert r.status_code == 400 and error_of(r)["param"] == "input"
    r = c.post("/v1/audio/speech", content=b"{not json", headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in error_of(r)["message"]
    r = c.post("/v1/audio/speech", json={**body, "volume": 3}, headers=auth)  # unknown field
    assert r.status_code == 400 and error_of(r)["param"] == "volume"
    r = c.get("/v1/nothing-here", headers=auth)
    assert r.status_code == 404 and error_of(r)["type"] == "not_found_error"
    assert c.get("/health").status_code == 503  # probes need no key
    assert c.get("/v1/openapi.json").status_code == 401  # the schema follows /v1's key
    assert c.get("/v1/openapi.json", headers=auth).json()["paths"]["/v1/audio/speech"]


# --- the real server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(studio_queue):
    """(base_url, voices_dir) of the shared `python app.py` (conftest.py): 2 running, 1 waiting, 2 MB uploads."""
    base, tmp = studio_queue
    return base, tmp / "voices"


@pytest.fixture(scope="module")
def voice(server):
    """A voice saved through POST /v1/voices (multipart)."""
    v = save_voice(server[0], "api-voice")
    assert (v["id"], v["object"], v["prompt_text"]) == ("api-voice", "voice", EN_TRANSCRIPT)
    assert 1.0 < v["prompt_seconds"] < 30
    return v["id"]


@pytest.fixture(scope="module")
def oai(server):
    from openai import OpenAI

    return OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def pcm_samples(data: bytes) -> np.ndarray:
    assert len(data) % 2 == 0
    return np.frombuffer(data, dtype="<i2")


def test_voices_crud_and_shared_store(server, voice):
    base, voices_dir = server
    listed = httpx.get(base + "/v1/voices").json()
    assert listed["object"] == "list" and voice in [v["id"] for v in listed["data"]]
    assert httpx.get(f"{base}/v1/voices/{voice}").json()["id"] == voice
    assert (voices_dir / f"{voice}.safetensors").is_file()  # the page's store: same folder, no pickle
    with EN_WAV.open("rb") as f:  # no name: one is made up; a taken name: 409
        r = httpx.post(base + "/v1/voices", files={"audio": ("a.wav", f)}, data={"transcript": ""}, timeout=60)
    made = r.json()["id"]
    assert r.status_code == 201 and made.startswith("voice-")
    with EN_WAV.open("rb") as f:
        r = httpx.post(base + "/v1/voices", files={"audio": ("a.wav", f)}, data={"name": made}, timeout=60)
    assert r.status_code == 409 and error_of(r)["code"] == "voice_exists"
    with EN_WAV.open("rb") as f:  # asked for: the taken name is replaced (the new transcript is kept)
        r = httpx.post(base + "/v1/voices", files={"audio": ("a.wav", f)},
                       data={"name": made, "transcript": "Replaced.", "overwrite": "true"}, timeout=60)
    assert r.status_code == 201 and r.json()["id"] == made and r.json()["prompt_text"] == "Replaced.", r.text
    r = httpx.delete(f"{base}/v1/voices/{made}")
    assert r.json() == {"id": made, "object": "voice", "deleted": True}
    assert httpx.delete(f"{base}/v1/voices/{made}").status_code == 404
    assert httpx.get(f"{base}/v1/voices/..%2F..%2Fetc").status_code in (400, 404)


def test_openai_sdk_streams_pcm_with_a_saved_voice(server, oai, voice):
    t0 = time.perf_counter()
    pieces, first_at = [], None
    with oai.audio.speech.with_streaming_response.create(model="cosyvoice2", voice=voice, input=TEXT,
                                                         response_format="pcm", extra_body={"seed": 7}) as r:
        assert r.headers["content-type"] == "audio/pcm" and r.headers["x-seed"] == "7"
        server_ttfa_ms = float(r.headers["x-ttfa-ms"])
        for piece in r.iter_bytes():
            first_at = first_at or time.perf_counter()
            pieces.append(piece)
    done = time.perf_counter()
    pcm = pcm_samples(b"".join(pieces))
    assert pcm.size > SAMPLES_PER_TOKEN and np.abs(pcm).max() > 0
    assert pcm.size % SAMPLES_PER_TOKEN == 0  # whole tokens of 24 kHz audio
    client_ttfa_ms = (first_at - t0) * 1e3
    assert 0 < server_ttfa_ms <= client_ttfa_ms  # the client sees the first audio after the server made it
    assert first_at < done  # audio arrived before the stream ended (streamed, not buffered)
    health = httpx.get(server[0] + "/health").json()
    assert health["active_streams"] == 0 and health["lm_unfinished"] == 0


def test_openai_sdk_wav_non_streamed_and_speed(oai, voice):
    wav = oai.audio.speech.create(model="tts-1", voice=voice, input=TEXT, response_format="wav",
                                  extra_body={"seed": 3}).content
    assert wav[:4] == b"RIFF" and wav[8:16] == b"WAVEfmt "
    channels, rate, bits = struct.unpack("<H", wav[22:24])[0], struct.unpack("<I", wav[24:28])[0], wav[34]
    assert (channels, rate, bits) == (1, OUTPUT_SAMPLE_RATE_HZ, 16) and wav[36:40] == b"data"
    normal = pcm_samples(wav[44:])
    slow = oai.audio.speech.create(model="tts-1", voice={"id": voice}, input=TEXT, response_format="pcm",
                                   speed=0.5, extra_body={"seed": 3}).content
    assert pcm_samples(slow).size > normal.size * 1.5  # speed 0.5 is ~twice as long (same seed and tokens)


def test_vllm_omni_benchmark_request_shape(server, voice):
    """The body and headers vLLM-Omni's `vllm bench serve --omni --backend openai-audio-speech` sends (its
    `stream: true`, and `Bearer None` when OPENAI_API_KEY is unset): streamed PCM; `stream: false` is whole."""
    url, headers = server[0] + "/v1/audio/speech", {"Authorization": "Bearer None"}
    body = {"model": "FunAudioLLM/CosyVoice2-0.5B", "input": TEXT, "stream": True, "stream_format": "audio",
            "response_format": "pcm", "voice": voice, "seed": 5}
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200 and "content-length" not in r.headers, r.read()
        pcm = pcm_samples(b"".join(r.iter_bytes()))
    assert pcm.size > SAMPLES_PER_TOKEN and pcm.size % SAMPLES_PER_TOKEN == 0
    r = httpx.post(url, json={**body, "stream": False}, headers=headers, timeout=120)
    assert r.status_code == 200 and int(r.headers["content-length"]) == len(r.content) > 0, r.text
    r = httpx.post(url, json={**body, "stream": False, "stream_format": "sse"}, timeout=30)
    assert r.status_code == 400 and error_of(r)["param"] == "stream" and "always streams" in error_of(r)["message"]
    r = httpx.post(url, json={**body, "speed": 0.8}, timeout=30)  # streamed audio has no speed: says what to do
    assert r.status_code == 400 and error_of(r)["param"] == "speed", r.text


def test_a_two_voice_dialogue_through_the_openai_sdk(server, oai, voice):
    """`dialogue: true` (extra_body): '[a] … [b] …' with saved voices, one streamed take. Its first turn is
    that turn spoken alone, sample for sample (same seed; segment 0 draws the same LM and HiFT noise); the
    second turn is in the second voice (a script whose second turn is in the first voice ends otherwise)."""
    zh = REPO / "assets" / "prompt_zh.wav"
    r = httpx.post(server[0] + "/v1/voices", files={"audio": ("zh.wav", zh.read_bytes(), "audio/wav")},
                   data={"name": "dlg-zh", "transcript": EXAMPLES["voices"][1]["transcript"], "overwrite": "true"},
                   timeout=60)
    assert r.status_code == 201, r.text
    first, second = "Good morning, how did you sleep?", "Very well, thank you."

    def pcm(text: str, **extra) -> np.ndarray:
        out = oai.audio.speech.create(model="cosyvoice2", voice=voice, input=text, response_format="pcm",
                                      extra_body={"seed": 9, **extra})
        return pcm_samples(out.read())

    alone = pcm(f"{first}")
    two = pcm(f"[{voice}] {first} [dlg-zh] {second}", dialogue=True)
    same = pcm(f"[{voice}] {first} [{voice}] {second}", dialogue=True)
    assert two.size > alone.size > 0
    np.testing.assert_array_equal(two[: alone.size], alone)
    np.testing.assert_array_equal(same[: alone.size], alone)
    assert not np.array_equal(two[alone.size:], same[alone.size: two.size])
    r = httpx.post(server[0] + "/v1/audio/speech", json={"model": "tts-1", "voice": voice, "dialogue": True,
                                                         "input": f"[{voice}] Hi. [nobody] Hello."}, timeout=60)
    err = error_of(r)
    assert r.status_code == 400 and (err["param"], err["code"]) == ("input", "voice_not_found"), err
    assert err["message"].startswith("Unknown speaker [nobody]: there is no saved voice named nobody; save a voice "
                                     "named nobody first, or use one of: "), err
    r = httpx.post(server[0] + "/v1/audio/speech", json={"model": "tts-1", "voice": voice, "dialogue": True,
                                                         "input": f"[{voice}] Hi. [dlg-zh]"}, timeout=60)
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_dialogue", r.text
    # a script that starts with a tag needs no `voice`; text before the first tag does, as any take
    r = httpx.post(server[0] + "/v1/audio/speech", json={"model": "tts-1", "dialogue": True, "response_format": "pcm",
                                                         "seed": 9, "input": f"[{voice}] {first} [dlg-zh] {second}"},
                   timeout=120)
    assert r.status_code == 200 and np.array_equal(pcm_samples(r.content), two), r.text[:300]
    r = httpx.post(server[0] + "/v1/audio/speech", json={"model": "tts-1", "dialogue": True,
                                                         "input": f"Hello. [{voice}] {first}"}, timeout=60)
    assert r.status_code == 400 and "needs a voice" in error_of(r)["message"], r.text
    r = httpx.post(server[0] + "/v1/audio/speech", json={"model": "tts-1", "input": "Hi."}, timeout=60)
    assert r.status_code == 400 and (error_of(r)["param"], error_of(r)["code"]) == ("voice", "missing"), r.text
    assert httpx.delete(f"{server[0]}/v1/voices/dlg-zh").status_code == 200


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, oai, voice):
    import openai

    base = server[0]
    cases = [
        (dict(voice="nobody"), 400, "voice", "no saved voice"),
        (dict(input="   "), 400, "input", "empty"),
        (dict(input="x" * 5000), 400, "input", "limit is 2000"),
        (dict(response_format="ogg"), 400, "response_format", "'mp3', 'opus', 'aac' or 'flac'"),
        (dict(speed=3.0), 400, "speed", "between"),
        (dict(extra_body={"seed": -5}), 400, "seed", "between"),
        (dict(extra_body={"fixed_tokens": 10**6}), 400, "fixed_tokens", "fixed_tokens"),
        (dict(extra_body={"mode": "instruct"}), 400, "instructions", "needs an instruction"),
        (dict(input="..."), 400, "input", "nothing speakable"),
    ]
    for kw, status, param, message in cases:
        args = dict(model="cosyvoice2", voice=voice, input=TEXT, response_format="pcm") | kw
        with pytest.raises(openai.APIStatusError) as e:
            oai.audio.speech.create(**args)
        err = e.value.response.json()["error"]
        assert e.value.status_code == status, (kw, err)
        assert err["param"] == param and message in err["message"], (kw, err)
    # uploads: not audio, too large, empty
    r = httpx.post(base + "/v1/voices", files={"audio": ("x.wav", b"this is not audio")}, timeout=30)
    assert r.status_code == 400 and error_of(r)["param"] == "audio"
    r = httpx.post(base + "/v1/voices", files={"audio": ("big.wav", b"\0" * (3 << 20))}, timeout=30)
    assert r.status_code == 413 and "max_upload_mb" in error_of(r)["message"]
    r = httpx.post(base + "/v1/voices", files={"audio": ("e.wav", b"")}, timeout=30)
    assert r.status_code == 400 and "empty" in error_of(r)["message"]
    r = httpx.post(base + "/v1/voices", files={"audio": ("a.wav", EN_WAV.read_bytes())}, data={"name": "../evil"})
    assert r.status_code == 400 and error_of(r)["param"] == "name"
    # special tokens typed into the text are removed, not obeyed
    ok = oai.audio.speech.create(model="cosyvoice2", voice=voice, input="<|endofprompt|>Hello.", response_format="pcm")
    assert pcm_samples(ok.content).size > 0


def test_busy_server_says_so_at_once(server, voice):
    base = server[0]
    long = {"model": "cosyvoice2", "voice": voice, "input": "Keep talking for a while.", "response_format": "pcm",
            "fixed_tokens": 1500}
    results: list[int] = []
    release = threading.Event()

    def hold() -> None:
        with httpx.stream("POST", base + "/v1/audio/speech", json=long, timeout=300) as r:
            results.append(r.status_code)
            pieces = r.iter_bytes()  # one iterator, kept: a discarded one closes the response
            next(pieces)  # the first audio arrived; hold the slot until released, then drop the stream
            release.wait(120)

    threads = [threading.Thread(target=hold) for _ in range(3)]  # 2 run, 1 waits for a slot
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while httpx.get(base + "/health").json()["http_waiting"] < 1:
        assert time.monotonic() < deadline, "the third request never waited for a slot"
        time.sleep(0.05)
    r = httpx.post(base + "/v1/audio/speech", json=long, timeout=30)
    assert r.status_code == 503 and error_of(r)["code"] == "server_busy" and r.headers["retry-after"]
    release.set()
    for t in threads:
        t.join(timeout=300)
    assert results == [200, 200, 200]
    deadline = time.monotonic() + 30  # dropped streams abort their LM requests
    while (h := httpx.get(base + "/health").json())["lm_unfinished"] or h["active_streams"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.1)
    assert h["requests"]["outcomes"]["cancelled"] >= 3


def test_readme_example_runs(server):
    """The README's /v1 example, as written, against the live server."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## HTTP API (OpenAI-style)", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict = {}
    exec(compile(code.replace("http://127.0.0.1:7860", server[0]), "README.md", "exec"), scope)
    assert len(scope["pcm"]) > 0 and len(scope["pcm"]) % 2 == 0 and scope["wav"][:4] == b"RIFF"
    assert not (server[1] / "fox.npz").exists()  # the example deleted the voice it saved


# --- the schema states what the server enforces ------------------------------------------------------


def request_schema(schema: dict, path: str) -> dict:
    """The properties of `path`'s POST body in the OpenAPI document (JSON or multipart)."""
    content = schema["paths"][path]["post"]["requestBody"]["content"]
    ref = next(iter(content.values()))["schema"]["$ref"]
    return schema["components"]["schemas"][ref.rsplit("/", 1)[-1]]["properties"]


def sentences(n: int) -> str:
    """Speakable text of exactly `n` characters (nothing a cleanup would trim)."""
    text = ("Hi there. " * (n // 10 + 1))[:n]
    return text[:-1] + "a" if text.endswith(" ") else text


def wav_of_size(n_bytes: int) -> bytes:
    """A valid 48 kHz stereo 16-bit WAV of exactly `n_bytes` (a multiple of 4 plus 44): the example speech, tiled."""
    import soundfile as sf

    speech, rate = sf.read(EN_WAV, dtype="float32")
    speech = speech if speech.ndim == 1 else speech.mean(axis=1)
    frames = (n_bytes - 44) // 4
    assert 44 + 4 * frames == n_bytes, n_bytes
    up = np.interp(np.arange(frames) * rate / 48_000 % speech.size, np.arange(speech.size), speech)
    pcm = np.repeat((up * 16000).astype("<i2")[:, None], 2, axis=1)
    header = (b"RIFF" + struct.pack("<I", 36 + pcm.nbytes) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 2, 48_000,
              192_000, 4, 16) + b"data" + struct.pack("<I", pcm.nbytes))
    return header + pcm.tobytes()


def test_schema_bounds_are_the_enforced_ones(server, voice):
    """Every bound the schema states is the one the server enforces: the bound itself is accepted, one past it
    refused (400 naming the field; an upload 413); its error responses are the real ones (no 422)."""
    base = server[0]
    schema = httpx.get(base + "/v1/openapi.json").json()
    for path, item in schema["paths"].items():
        for method, op in item.items():
            assert "422" not in op["responses"], (path, method)
            for status, r in op["responses"].items():
                if status[0] in "45":
                    assert r["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody"), (path, status)
    assert {"400", "413", "503"} <= set(schema["paths"]["/v1/audio/speech"]["post"]["responses"])
    speech = request_schema(schema, "/v1/audio/speech")
    voices = request_schema(schema, "/v1/voices")
    imports = request_schema(schema, "/v1/voices/import")

    def speak(**fields) -> tuple[int, dict]:
        """(status, error or {}) of a speech request; an accepted stream is closed once it started."""
        body = {"model": "cosyvoice2", "voice": voice, "input": "Hello.", "response_format": "pcm", "seed": 1,
                "fixed_tokens": 5, **fields}
        with httpx.stream("POST", base + "/v1/audio/speech", json=body, timeout=300) as r:
            got = (r.status_code, {} if r.status_code == 200 else error_of(httpx.Response(r.status_code,
                                                                                         content=r.read())))
        deadline = time.monotonic() + 60  # a closed stream frees its slot: the next request finds one
        while httpx.get(base + "/health").json()["active_streams"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        return got

    def bound(field: str, at: dict, past: dict, param: str | None = None) -> None:
        status, err = speak(**at)
        assert status == 200, (field, at, err)
        status, err = speak(**past)
        assert status == 400 and err["param"] == (param or field), (field, past, err)

    n = speech["input"]["maxLength"]
    bound("input", {"input": sentences(n)}, {"input": sentences(n + 1)})
    n = speech["instructions"]["maxLength"]
    bound("instructions", {"instructions": sentences(n)}, {"instructions": sentences(n + 1)})
    lo, hi = speech["speed"]["minimum"], speech["speed"]["maximum"]
    bound("speed", {"speed": lo}, {"speed": lo - 1e-6})
    bound("speed", {"speed": hi}, {"speed": hi + 1e-6})
    lo, hi = int(speech["seed"]["minimum"]), int(speech["seed"]["maximum"])
    bound("seed", {"seed": lo}, {"seed": lo - 1})
    bound("seed", {"seed": hi}, {"seed": hi + 1})
    lo, hi = speech["fixed_tokens"]["minimum"], speech["fixed_tokens"]["maximum"]
    bound("fixed_tokens", {"fixed_tokens": lo}, {"fixed_tokens": lo - 1})
    bound("fixed_tokens", {"fixed_tokens": hi}, {"fixed_tokens": hi + 1})
    bound("model", {"model": speech["model"]["enum"][-1]}, {"model": "tts-2"})
    assert speech["stream_format"]["enum"] == ["audio", "sse"]
    bound("stream_format", {"stream_format": "sse"}, {"stream_format": "events"})
    assert speech["response_format"]["enum"] == ["wav", "pcm", "mp3", "opus", "aac", "flac"]
    # voice names: the longest a name may be is saved and spoken with; one more is refused everywhere
    n = voices["name"]["maxLength"]
    assert speech["voice"]["maxLength"] == n and imports["name"]["maxLength"] == n
    long_name, too_long = "v" * n, "v" * (n + 1)
    clip = EN_WAV.read_bytes()
    r = httpx.post(base + "/v1/voices", files={"audio": ("a.wav", clip)}, timeout=60,
                   data={"name": long_name, "transcript": EN_TRANSCRIPT})
    assert r.status_code == 201, r.text
    bound("voice", {"voice": long_name}, {"voice": too_long})
    bound("voice", {"voice": {"id": long_name}}, {"voice": {"id": too_long}}, param="voice.id")
    r = httpx.post(base + "/v1/voices", files={"audio": ("a.wav", clip)}, data={"name": too_long}, timeout=60)
    assert r.status_code == 400 and error_of(r)["param"] == "name", r.text
    r = httpx.post(base + "/v1/voices/import", files={"file": ("v.cvvoice", b"x")}, data={"name": too_long})
    assert r.status_code == 400 and error_of(r)["param"] == "name", r.text
    n = voices["transcript"]["maxLength"]
    for text, status in ((sentences(n), 201), (sentences(n + 1), 400)):
        r = httpx.post(base + "/v1/voices", files={"audio": ("a.wav", clip)}, timeout=60,
                       data={"name": "bounded", "transcript": text, "overwrite": "true"})
        assert r.status_code == status and (status == 201 or error_of(r)["param"] == "transcript"), r.text
    # uploads: a file of the stated size is taken (a real clip at exactly the limit); one byte more is 413
    n = voices["audio"]["maxLength"]
    at = wav_of_size(n)
    r = httpx.post(base + "/v1/voices", files={"audio": ("big.wav", at)}, timeout=120,
                   data={"name": "at-limit", "transcript": EN_TRANSCRIPT})
    assert r.status_code == 201, r.text
    r = httpx.post(base + "/v1/voices", files={"audio": ("big.wav", at + b"\0")}, timeout=120)
    assert r.status_code == 413 and error_of(r)["param"] == "audio", r.text
    n = imports["file"]["maxLength"]
    r = httpx.post(base + "/v1/voices/import", files={"file": ("v.cvvoice", b"\0" * n)}, timeout=120)
    assert r.status_code == 400 and error_of(r)["param"] == "file", r.text  # read, then found damaged: not 413
    r = httpx.post(base + "/v1/voices/import", files={"file": ("v.cvvoice", b"\0" * (n + 1))}, timeout=120)
    assert r.status_code == 413 and error_of(r)["param"] == "file", r.text
    for name in (long_name, "bounded", "at-limit"):
        assert httpx.delete(f"{base}/v1/voices/{name}").status_code == 200


def test_wrong_method_and_unknown_field_say_what_to_do(server):
    base = server[0]
    r = httpx.get(base + "/v1/audio/speech")
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
    assert error_of(r)["code"] == "method_not_allowed" and "use POST" in error_of(r)["message"]
    r = httpx.put(base + "/v1/voices/x")
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET"
    assert httpx.get(base + "/v1/no-such-thing").status_code == 404
    r = httpx.post(base + "/v1/audio/speech", json={"model": "tts-1", "text": "Hello.", "voice": "x"})
    err = error_of(r)
    assert r.status_code == 400 and err["param"] == "text", err  # not "input: Field required"
    assert "unknown field 'text'" in err["message"] and "input, voice" in err["message"], err
    r = httpx.post(base + "/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "voice": "x", "instruction": "a"})
    assert "did you mean 'instructions'" in error_of(r)["message"], r.text


