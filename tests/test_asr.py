"""Transcription of reference clips: the real Whisper loading and decoding code on random-weights tiny
Whispers built here (app/model/random/whisper.py, no download), the shared transcriber, and a blank transcript
through /v1/voices and the Gradio API, with the model configured and offline without one (no Hub here).
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from studio import EXAMPLE_WAV

from app.audio import load_audio
from app.config import AsrConfig, ConfigError, load_config
from app.model.asr import AsrInputError, AsrModelError, WhisperAsr
from app.model.random.whisper import RIGGED_LANGUAGE, RIGGED_WORD, make_tiny_whisper
from app.service.asr import AsrUnavailable, Transcriber

REPO = Path(__file__).resolve().parents[1]

TEXT = "Hello there, how are you today?"


@pytest.fixture(scope="module")
def rigged(tmp_path_factory):
    return make_tiny_whisper(tmp_path_factory.mktemp("whisper") / "rigged", rigged=True)


@pytest.fixture(scope="module")
def random_whisper(tmp_path_factory):
    return make_tiny_whisper(tmp_path_factory.mktemp("whisper") / "random", seed=1)


def _wav(samples: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def test_config_section():
    cfg = load_config()
    assert cfg.asr.enabled and cfg.asr.model_id == "openai/whisper-large-v3-turbo" and cfg.asr.device == "auto"
    assert load_config(None, {"asr.enabled": False}).asr.enabled is False
    with pytest.raises(ConfigError, match=r"asr\.device"):
        load_config(None, {"asr.device": "tpu"})
    with pytest.raises(ConfigError, match=r"asr\.model_id"):
        AsrConfig(model_id="")


def test_rigged_whisper_text_and_language(rigged):
    asr = WhisperAsr.load(rigged, "auto")  # no GPU here: auto = cpu, float32
    assert asr.device == "cpu" and str(asr.dtype) == "torch.float32"
    got = asr.transcribe(EXAMPLE_WAV)
    assert got.language == RIGGED_LANGUAGE  # detected
    assert got.text and set(got.text.split(RIGGED_WORD)) == {""}, got.text  # the rigged word, repeated
    assert len(got.text) // len(RIGGED_WORD) == asr.max_new_tokens  # no end token: capped at the decoder's room
    assert asr.transcribe(EXAMPLE_WAV, "zh").language == "zh"  # asked for: not detected
    with pytest.raises(AsrInputError, match="unknown Whisper language"):
        asr.transcribe(EXAMPLE_WAV, "xx")


def test_resampling_and_channels(random_whisper):
    """Whatever the rate and channels, Whisper hears app/audio.py's 16 kHz mono of the clip."""
    asr = WhisperAsr.load(random_whisper, "cpu")
    mono16 = load_audio(EXAMPLE_WAV, 16_000)[0].numpy()
    at16 = asr.transcribe(_wav(mono16, 16_000), "en")
    mono48 = load_audio(EXAMPLE_WAV, 48_000)[0].numpy()
    stereo48 = _wav(np.stack([mono48, mono48], axis=1), 48_000)
    # the random model's words depend on the audio: a different clip gives different ids
    assert asr.transcribe(stereo48, "en") == at16
    other = asr.transcribe(_wav(np.random.default_rng(0).normal(0, 0.1, 48_000).astype(np.float32), 16_000), "en")
    assert asr.transcribe(EXAMPLE_WAV, "en").language == "en" and isinstance(other.text, str)


def test_errors(rigged, tmp_path):
    asr = WhisperAsr.load(rigged)
    with pytest.raises(AsrInputError, match="at most 30 s"):
        asr.transcribe(_wav(np.zeros(31 * 16_000, np.float32), 16_000))
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in rigged.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AsrModelError, match=r"cannot be loaded.*delete it to download it again"):
        WhisperAsr.load(broken)
    (broken / "config.json").write_text("{")
    with pytest.raises(AsrModelError, match="cannot be loaded"):
        WhisperAsr.load(broken)
    with pytest.raises(AsrModelError, match="cannot be loaded"):
        WhisperAsr.load(tmp_path / "missing")


def test_transcriber_loads_once_caches_and_reports_offline(rigged, monkeypatch):
    loads = []
    real_load = WhisperAsr.load

    def counting_load(folder, device="auto"):
        loads.append(folder)
        return real_load(folder, device)

    monkeypatch.setattr(WhisperAsr, "load", counting_load)

    async def main():
        tr = Transcriber(AsrConfig(model_id=str(rigged), device="cpu"))
        a, b = await asyncio.gather(tr.transcribe(EXAMPLE_WAV), tr.transcribe(EXAMPLE_WAV.read_bytes()))
        assert a == b and a.language == RIGGED_LANGUAGE and len(loads) == 1 and tr.cfg.enabled and not tr.error
        assert tr.status.startswith("ready")
        # offline (no Hub here), nothing cached: a clear reason, remembered until retry
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        off = Transcriber(AsrConfig(model_id="openai/whisper-tiny-never-cached"))
        with pytest.raises(AsrUnavailable, match="automatic transcription is unavailable: cannot download"):
            await off.transcribe(EXAMPLE_WAV)
        assert off.error
        with pytest.raises(AsrUnavailable, match="unavailable"):
            await off.transcribe(EXAMPLE_WAV)
        no_dl = Transcriber(AsrConfig(model_id="openai/whisper-tiny-never-cached", download=False))
        with pytest.raises(AsrUnavailable, match=r"asr\.download is off"):
            await no_dl.transcribe(EXAMPLE_WAV)
        with pytest.raises(AsrUnavailable, match="off"):
            await Transcriber(AsrConfig(enabled=False)).transcribe(EXAMPLE_WAV)
        with pytest.raises(AsrUnavailable, match="could not be transcribed"):
            await tr.transcribe(b"RIFF this is not audio")

    asyncio.run(main())


# --- through the server: /v1/voices and the Gradio API ---------------------------------------------------


def _post_voice(base: str, name: str, transcript: str = "") -> dict:
    r = httpx.post(f"{base}/v1/voices", files={"audio": ("ref.wav", EXAMPLE_WAV.read_bytes(), "audio/wav")},
                   data={"transcript": transcript, "name": name}, timeout=120)
    assert r.status_code == 201, r.text
    return r.json()


@pytest.fixture()
def transcribing(studio_asr):
    """(base_url, tmp) of a `python app.py` with the rigged Whisper to transcribe (conftest.py's, shared with
    test_i18n.py)."""
    return studio_asr


@pytest.mark.slow
def test_blank_transcript_transcribed_through_both_apis(transcribing):
    from gradio_client import Client, handle_file

    base, _ = transcribing
    v = _post_voice(base, "auto")
    assert RIGGED_WORD in v["prompt_text"], v  # the transcript used
    assert any(w.startswith(f"transcribed the reference ({RIGGED_LANGUAGE})") for w in v["warnings"]), v
    typed = _post_voice(base, "typed", "Words I typed.")  # a typed transcript is kept
    assert RIGGED_WORD not in typed["prompt_text"] and not typed["warnings"]
    client = Client(base, verbose=False)
    assert set(client.predict(prompt_audio=handle_file(str(EXAMPLE_WAV)), api_name="/transcribe").split(
        RIGGED_WORD)) == {""}
    _, _, _, details = client.predict(
        text=TEXT, prompt_audio=handle_file(str(EXAMPLE_WAV)), prompt_text="", mode="zero_shot",
        instruct_text="", voice="", seed=1, speed=1.0, stream=False, api_name="/synthesize")
    assert details["mode"] == "zero_shot", details  # not cross-lingual: it was transcribed
    assert any(n.startswith("transcribed the reference") for n in details["notes"]), details
    msg, _ = client.predict(name="saved", prompt_audio=handle_file(str(EXAMPLE_WAV)), prompt_text="",
                            overwrite=False, api_name="/save_voice")
    assert "transcribed the reference" in msg and "cross-lingual" not in msg, msg


@pytest.mark.slow
def test_blank_transcript_offline_falls_back_to_cross_lingual(studio_bf16):
    """No model folder and no Hub (HF_HUB_OFFLINE=1, as in every studio test): what it says, and today's mode.
    On conftest.py's studio_bf16 (model.download = false); the voice saved here is deleted at the end."""
    from gradio_client import Client, handle_file

    base, _ = studio_bf16
    v = _post_voice(base, "asr-offline")
    assert v["prompt_text"] == "" and any("automatic transcription is unavailable" in w for w in v["warnings"])
    client = Client(base, verbose=False)
    _, _, _, details = client.predict(
        text=TEXT, prompt_audio=handle_file(str(EXAMPLE_WAV)), prompt_text="", mode="zero_shot",
        instruct_text="", voice="", seed=1, speed=1.0, stream=False, api_name="/synthesize")
    assert details["mode"] == "cross_lingual", details
    assert any("automatic transcription is unavailable: cannot download" in n for n in details["notes"])
    assert "no transcript: used cross-lingual mode (the voice without its words)" in details["notes"]
    from gradio_client.exceptions import AppError
    with pytest.raises(AppError, match="automatic transcription is unavailable"):
        client.predict(prompt_audio=handle_file(str(EXAMPLE_WAV)), api_name="/transcribe")
    assert httpx.get(f"{base}/health", timeout=10).json()["ready"]  # still serving
    assert httpx.delete(f"{base}/v1/voices/asr-offline", timeout=30).status_code == 200


@pytest.mark.slow
def test_readme_gradio_client_example_runs_as_written(transcribing, monkeypatch):
    """README's Gradio API example, as written, against `python app.py` with a Whisper to transcribe (a local
    random one here; the Hub's for a user); it ends by deleting the voice it saved."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    code = readme.split("## Gradio API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert 'Client("http://127.0.0.1:7860/")' in code and "/transcribe" in code
    base, tmp = transcribing
    before = sorted((tmp / "voices").iterdir()) if (tmp / "voices").is_dir() else []
    monkeypatch.chdir(REPO)  # the example's paths are relative to the repository
    exec(compile(code.replace("http://127.0.0.1:7860/", base + "/"), "README.md", "exec"), {})
    after = sorted((tmp / "voices").iterdir()) if (tmp / "voices").is_dir() else []
    assert after == before  # the example deleted the voice it saved (the other test's voices stay)
