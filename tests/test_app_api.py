"""The studio end to end: `python app.py` in a subprocess (tiny model, real vLLM CPU engine), driven
through its documented Gradio API with `gradio_client`, plus the saved-voice store on its own.

One server, shared with test_openai_api.py (conftest.py's studio_queue). Its queue is small on purpose
(2 running, 1 waiting) so the queue-full test needs only four requests.
"""

from __future__ import annotations

import json
import pickle
import time
import wave
from pathlib import Path

import httpx
import numpy as np
import pytest
import safetensors.numpy
import torch

from app.audio import OUTPUT_SAMPLE_RATE_HZ, SAMPLES_PER_TOKEN
from app.model.frontend import VoiceFeatures
from app.service.voices import VoiceError, VoiceStore, check_name

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = json.loads((REPO / "assets" / "examples.json").read_text(encoding="utf-8"))
EN_WAV, EN_TRANSCRIPT = REPO / "assets" / "prompt_en.wav", EXAMPLES["voices"][0]["transcript"]
TEXT = "Hello there, how are you today?"
# ~1860 chars (under ui.max_text_chars 2000): long enough that the two running requests outlast the
# queue-full and cancel checks even on an idle machine (12 sentences finished too early on a fresh clone)
LONG_TEXT = " ".join(["This long sentence keeps the model talking for quite a while."] * 30)


# --- the saved-voice store (no server) ---------------------------------------------------------------


def _voice(text: str = "hello") -> VoiceFeatures:
    g = torch.Generator().manual_seed(0)
    return VoiceFeatures(prompt_text=text, prompt_text_ids=torch.arange(5, dtype=torch.int32),
                         speech_tokens=torch.randint(0, 6561, (1, 50), generator=g, dtype=torch.int32),
                         speech_mel=torch.randn(1, 100, 80, generator=g), embedding=torch.randn(1, 192, generator=g))


def test_voice_store_roundtrip_and_safe_names(tmp_path):
    store = VoiceStore(tmp_path / "voices", model_fingerprint="abc")
    v = _voice("你好, world")
    info = store.save("alice", v)
    assert info.prompt_seconds == 2.0 and store.names() == ["alice"]
    got = VoiceStore(tmp_path / "voices", model_fingerprint="abc").load("alice")  # a new store: survives restarts
    assert got.prompt_text == v.prompt_text
    for k in ("prompt_text_ids", "speech_tokens", "speech_mel", "embedding"):
        assert torch.equal(getattr(got, k), getattr(v, k)), k
    stored = safetensors.numpy.load_file(tmp_path / "voices" / "alice.safetensors")  # plain arrays, no pickle
    assert set(stored) == {"prompt_text_ids", "speech_tokens", "speech_mel", "embedding"}
    with pytest.raises(VoiceError, match="exists already") as taken:
        store.save("alice", v)
    assert taken.value.code == "exists"  # what the doors choose a 409 / "Name taken" by
    assert pickle.loads(pickle.dumps(taken.value)).code == "exists"
    store.save("alice", _voice("replaced"), overwrite=True)
    assert store.load("alice").prompt_text == "replaced"
    assert check_name("声音_1") == "声音_1"
    for bad in ("../evil", "a/b", "..", ".hidden", "a b", "", "-x", "x" * 65, "a.npz", "C:\\x"):
        with pytest.raises(VoiceError, match="invalid voice name") as invalid:
            store.save(bad, v)
        assert invalid.value.code == "invalid_name", bad
    assert sorted(p.name for p in (tmp_path / "voices").iterdir()) == ["alice.safetensors"]
    assert not list(tmp_path.glob("evil*"))
    # another model's features are not offered and not loaded
    other = VoiceStore(tmp_path / "voices", model_fingerprint="zzz")
    assert other.names() == []
    with pytest.raises(VoiceError, match="another model") as other_model:
        other.load("alice")
    assert other_model.value.code == "other_model"
    store.delete("alice")
    assert store.names() == [] and not list((tmp_path / "voices").iterdir())
    with pytest.raises(VoiceError, match="no saved voice") as unknown:
        store.delete("alice")
    assert unknown.value.code == "not_found"


def test_space_front_matter_and_files():
    import gradio
    import yaml
    from huggingface_hub import SpaceHardware

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert readme.startswith("---\n")
    meta = yaml.safe_load(readme.split("---\n", 2)[1])
    assert meta["sdk"] == "gradio" and str(meta["sdk_version"]) == gradio.__version__ == "6.31.0"
    assert (REPO / meta["app_file"]).is_file() and meta["app_file"] == "app.py"
    assert meta["models"] == ["FunAudioLLM/CosyVoice2-0.5B"] and str(meta["python_version"]).startswith("3.")
    assert meta["suggested_hardware"] in {h.value for h in SpaceHardware}
    assert "gradio==6.31.0" in (REPO / "requirements.txt").read_text().splitlines()
    assert (REPO / "packages.txt").read_text().split() == ["ffmpeg"]


def test_config_sections_and_labels():
    from app.config import ConfigError, load_config
    from app.ui.i18n import labels

    EN, ZH = labels("en"), labels("zh")

    cfg = load_config(None, {"server.port": 8000, "server.concurrency_limit": 3})
    assert (cfg.server.port, cfg.server.concurrency_limit, cfg.ui.panel_refresh_s) == (8000, 3, 1.0)
    for bad in ({"server.port": 0}, {"server.queue_max_size": 0}, {"server.typo": 1}, {"ui.status_refresh_s": 0}):
        with pytest.raises(ConfigError):
            load_config(None, bad)
    assert EN.keys() == ZH.keys()


def test_download_progress_reaches_the_status():
    from app.model.source import progress_class as _progress_class

    seen = []
    bar_cls = _progress_class(lambda done, total: seen.append((done, total)))
    bar = bar_cls(name="huggingface_hub.snapshot_download", total=0, unit="B", disable=True)
    bar.total = 1000  # huggingface_hub grows the total as files are found
    bar.update(400)
    bar.update(600)
    other = bar_cls(name="huggingface_hub.snapshot_download.transfer", total=1000, unit="B", disable=True)
    other.update(10)  # only the reconstruct (bytes on disk) bar is reported
    assert seen == [(400, 1000), (1000, 1000)]


def test_service_start_failure_is_reported_not_raised(tmp_path):
    import asyncio

    from app.config import load_config
    from app.service.service import NotReadyError, StudioService

    service = StudioService(load_config(None, {"model.dir": str(tmp_path / "missing"),
                                               "server.voices_dir": str(tmp_path / "v")}))
    with pytest.raises(NotReadyError, match="still loading"):
        service.require_ready()
    asyncio.run(service.start())
    assert not service.ready and "does not exist" in service.status and service.health()["error"]
    with pytest.raises(NotReadyError, match="failed to start"):
        service.require_ready()


# --- the server ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(studio_queue):
    """(base_url, voices_dir) of the shared `python app.py` (conftest.py). Queue: 2 running, 1 waiting."""
    base, tmp = studio_queue
    return base, tmp / "voices"


def _files(folder: Path) -> set[str]:
    """The names in a voices folder (the server shares it with other files' tests)."""
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


@pytest.fixture(scope="module")
def client(server):
    from gradio_client import Client

    return Client(server[0] + "/", verbose=False)


def synth(client, **kw):
    from gradio_client import handle_file

    args = dict(text=TEXT, prompt_audio=handle_file(str(EN_WAV)), prompt_text=EN_TRANSCRIPT, mode="zero_shot",
                instruct_text="", voice="", seed=1, speed=1.0, stream=True)
    args.update(kw)
    return client.predict(**args, api_name="/synthesize")


def check_wav(result, *, speed: float = 1.0) -> dict:
    """The final WAV is 16-bit mono 24 kHz, non-empty, as long as the server reports (tokens x 960)."""
    _, wav_path, line, details = result
    with wave.open(wav_path) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (OUTPUT_SAMPLE_RATE_HZ, 1, 2)
        n = w.getnframes()
        pcm = np.frombuffer(w.readframes(n), dtype="<i2")
    assert n > 0 and np.abs(pcm).max() > 0
    assert n == details["audio_samples"] and abs(n / OUTPUT_SAMPLE_RATE_HZ - details["audio_s"]) < 1e-3
    assert n == pytest.approx(details["tokens"] * SAMPLES_PER_TOKEN / speed, rel=0.02)
    for key in ("TTFA", "RTF", "tokens/s", "audio", "LM", "flow", "vocoder", f"seed {details['seed']}"):
        assert key in line, (key, line)
    return details


def health(server) -> dict:
    return httpx.get(server[0] + "/health", timeout=5).json()


def test_api_surface(client):
    api = client.view_api(return_format="dict", print_info=False)["named_endpoints"]
    assert [p["parameter_name"] for p in api["/synthesize"]["parameters"]] == [
        "text", "prompt_audio", "prompt_text", "mode", "instruct_text", "voice", "seed", "speed", "stream", "dialogue"]
    assert {"/save_voice", "/delete_voice", "/list_voices"} <= set(api)


def test_zero_shot_streams_then_final_wav(client):
    from gradio_client import handle_file

    job = client.submit(text=TEXT, prompt_audio=handle_file(str(EN_WAV)), prompt_text=EN_TRANSCRIPT,
                        mode="zero_shot", instruct_text="", voice="", seed=1, speed=1.0, stream=True,
                        api_name="/synthesize")
    result = job.result(timeout=120)
    details = check_wav(result)
    assert details["mode"] == "zero_shot" and details["stream"] and details["chunks"] >= 1
    live = [o[0] for o in job.outputs()[:-1] if isinstance(o[0], str)]
    assert live and all(p.endswith(".wav") for p in live)  # each chunk came as a WAV of its own
    again = check_wav(synth(client))  # same seed, same voice: the same audio length
    assert again["audio_samples"] == details["audio_samples"]


def test_cross_lingual_fallback_and_speed(client):
    d = check_wav(synth(client, prompt_text="", seed=3))  # no transcript: cross-lingual, and it says so
    assert d["mode"] == "cross_lingual" and any("cross-lingual" in n for n in d["notes"])
    d = check_wav(synth(client, mode="cross_lingual", stream=False, speed=1.25, seed=4), speed=1.25)
    assert d["mode"] == "cross_lingual" and not d["stream"] and d["speed"] == 1.25


def test_instruct(client):
    d = check_wav(synth(client, mode="instruct", instruct_text="Speak slowly and calmly.", seed=-1))
    assert d["mode"] == "instruct" and 0 <= d["seed"] < 2**31  # -1 picked a random seed and reports it


def test_saved_voice_by_name(client, server):
    from gradio_client.exceptions import AppError

    files, names = _files(server[1]), {v["name"] for v in client.predict(api_name="/list_voices")}
    msg, value = client.predict(name="test-voice_1", prompt_audio=_handle(EN_WAV), prompt_text=EN_TRANSCRIPT,
                                api_name="/save_voice")
    assert "test-voice_1" in msg and value == "test-voice_1"
    assert _files(server[1]) == files | {"test-voice_1.safetensors"}
    voices = client.predict(api_name="/list_voices")
    assert {v["name"] for v in voices} == names | {"test-voice_1"}
    (listed,) = [v for v in voices if v["name"] == "test-voice_1"]
    assert listed["prompt_text"]
    d = check_wav(synth(client, prompt_audio=None, prompt_text="", voice="test-voice_1"))
    assert d["voice"] == "test-voice_1" and d["mode"] == "zero_shot"  # the stored transcript is used
    with pytest.raises(AppError, match=r"exists already.*Replace"):  # a taken name is not overwritten silently
        client.predict(name="test-voice_1", prompt_audio=_handle(EN_WAV), prompt_text="", api_name="/save_voice")
    listed = next(v for v in client.predict(api_name="/list_voices") if v["name"] == "test-voice_1")
    assert listed["prompt_text"]  # still the first one's transcript
    msg, _ = client.predict(name="test-voice_1", prompt_audio=_handle(EN_WAV), prompt_text=EN_TRANSCRIPT,
                            overwrite=True, api_name="/save_voice")
    assert "Saved voice" in msg
    with pytest.raises(AppError, match="invalid voice name"):
        client.predict(name="../evil", prompt_audio=_handle(EN_WAV), prompt_text="", api_name="/save_voice")
    assert not list(server[1].parent.glob("evil*"))
    msg, value = client.predict(voice="test-voice_1", api_name="/delete_voice")
    assert "Deleted" in msg and value == "" and _files(server[1]) == files
    with pytest.raises(AppError, match="no saved voice"):
        synth(client, prompt_audio=None, voice="test-voice_1")


def test_a_dialogue_through_the_page(client, server):
    """Dialogue on: '[a] … [b] …' with two saved voices, through the page's Gradio event (its final WAV and
    details) and through /studio/speech, the low-latency player's route (the same take, byte for byte)."""
    zh = REPO / "assets" / "prompt_zh.wav"
    for name, wav, words in (("dlg-a", EN_WAV, EN_TRANSCRIPT), ("dlg-b", zh, EXAMPLES["voices"][1]["transcript"])):
        client.predict(name=name, prompt_audio=_handle(wav), prompt_text=words, overwrite=True,
                       api_name="/save_voice")
    script = "[dlg-a] Good morning, how did you sleep? [dlg-b] Very well, thank you."
    d = check_wav(result := synth(client, text=script, prompt_audio=None, prompt_text="", dialogue=True, seed=4))
    assert (d["voice"], d["segments"], d["mode"]) == ("dlg-a, dlg-b", 2, "zero_shot"), d
    with wave.open(result[1]) as w:
        page_pcm = w.readframes(w.getnframes())
    r = httpx.post(server[0] + "/studio/speech", json={"text": script, "dialogue": True, "seed": 4}, timeout=120)
    assert r.status_code == 200 and r.content == page_pcm  # same seed, same take
    r = httpx.post(server[0] + "/studio/speech", json={"text": "[dlg-a] Hi. [nobody] Hello.", "dialogue": True},
                   timeout=60)
    assert r.status_code == 400 and "Unknown speaker [nobody]: " in r.json()["error"]["message"], r.text
    for name in ("dlg-a", "dlg-b"):
        client.predict(voice=name, api_name="/delete_voice")


def _handle(path):
    from gradio_client import handle_file

    return handle_file(str(path))


def test_bad_inputs_give_clear_errors_then_next_request_works(client, tmp_path):
    from gradio_client.exceptions import AppError

    not_audio = tmp_path / "notes.wav"
    not_audio.write_text("this is not audio")
    cases = [
        (dict(text="   "), "Type the text"),
        (dict(text="x" * 5000), "limit is 2000"),
        (dict(mode="instruct", instruct_text=""), "needs an instruction"),
        (dict(prompt_audio=None), "Upload or record a reference"),
        (dict(speed=1.5), "only without streaming"),
        (dict(prompt_audio=_handle(not_audio)), "not a readable audio file"),
        (dict(voice="nobody"), "no saved voice"),
        (dict(text="...", prompt_text=""), "nothing speakable"),
    ]
    for kw, message in cases:
        with pytest.raises(AppError, match=message):
            synth(client, **kw)
            pytest.fail(f"no error for {message!r}")
    with pytest.raises(Exception, match=r"choices|mode"):  # Gradio rejects a value outside the Radio's choices
        synth(client, mode="sing")
    check_wav(synth(client, seed=5))


def test_stop_aborts_and_full_queue_is_refused(client, server):
    """Two listeners stream (concurrency_limit 2), a third waits (queue_max_size 1), a fourth is refused;
    Stop (cancel) takes the waiting one out of the queue and aborts the running ones' engine requests.

    Each listener has its own client (session), as separate pages do: Gradio's cancel stops every
    running task of the same session and function, which with one shared session let the waiting job
    start in the slots freed by the first cancel before its own cancel arrived. The second running job
    joins once the first has left the queue (it holds one waiting event: two joins at once could find it
    full), and both are streaming before the third is submitted, so the third always finds them out of it."""
    from gradio_client import Client, handle_file
    from gradio_client.utils import QueueError, Status

    kw = dict(text=LONG_TEXT, prompt_audio=handle_file(str(EN_WAV)), prompt_text=EN_TRANSCRIPT, mode="zero_shot",
              instruct_text="", voice="", seed=1, speed=1.0, stream=True, api_name="/synthesize")
    deadline = time.monotonic() + 60
    while (h := health(server))["active_streams"] or h["lm_unfinished"]:  # earlier tests' takes have ended
        assert time.monotonic() < deadline, h
        time.sleep(0.1)
    before = h["requests"]["outcomes"]
    listeners = [Client(server[0] + "/", verbose=False) for _ in range(3)]
    running = []
    deadline = time.monotonic() + 60
    for c in listeners[:2]:  # the second joins once the first left the queue: Gradio's queue has one place
        running.append(c.submit(**kw))
        while running[-1].status().code not in (Status.PROCESSING, Status.ITERATING, Status.PROGRESS, Status.LOG):
            assert time.monotonic() < deadline and not running[-1].done(), running[-1].status()
            time.sleep(0.02)
    while health(server)["active_streams"] < 2:  # both running ones are out of the queue, streaming
        assert time.monotonic() < deadline and not any(j.done() for j in running), [j.status() for j in running]
        time.sleep(0.1)
    waiting = listeners[2].submit(**kw)
    while waiting.status().code != Status.IN_QUEUE:  # it holds the only queue slot (submit is asynchronous)
        assert time.monotonic() < deadline and not waiting.done(), waiting.status()
        time.sleep(0.05)
    with pytest.raises(QueueError, match="Queue is full"):
        client.submit(**kw).result(timeout=30)
    while (h := health(server))["lm_unfinished"] < 1:  # stop while the engine is generating for them
        assert time.monotonic() < deadline, h
        time.sleep(0.02)
    waiting.cancel()  # out of the queue first, so it cannot take a slot the running ones free
    for j in running:
        j.cancel()  # what the page's Stop does: Gradio cancels the event and closes the generator
    deadline = time.monotonic() + 15
    while (h := health(server))["active_streams"] or h["lm_unfinished"]:
        assert time.monotonic() < deadline, {k: h[k] for k in ("active_streams", "lm_unfinished", "requests")}
        time.sleep(0.1)
    after = h["requests"]["outcomes"]
    assert after["cancelled"] - before["cancelled"] == 2, (before, after)  # the waiting one never started
    assert after["ok"] == before["ok"]
    check_wav(synth(client, seed=6))  # the engine still serves


