"""Audio loading, resampling, WAV encoding and the frontend features/ONNX wrappers.

Parity tests compare against `frontend.npz` (official load_wav / whisper / kaldi / matcha / ONNX outputs):
case `a_` is prompt_24k.wav, case `b_` is prompt_16k.wav.
"""

from __future__ import annotations

import io
import math
import sys

import numpy as np
import pytest
import soundfile as sf
import torch
from tolerances import (
    AUDIO_ATOL,
    FBANK_ATOL,
    LOGMEL_ATOL,
    OWN_TOKEN_AGREEMENT,
    OWN_XVECTOR_ATOL,
    XVECTOR_ATOL,
    at_least,
    within,
)

from app.audio import AudioError, load_audio, to_int16_pcm, wav_bytes
from app.model.features import cmn, kaldi_fbank, prompt_mel, whisper_log_mel
from app.model.hparams import ModelFolderError, load_hparams
from app.model.onnx_models import (
    SPEAKER_ENCODER_FILE,
    SPEECH_TOKENIZER_FILE,
    SpeakerEncoderOnnx,
    SpeechTokenizerOnnx,
    make_session,
)
from app.resample import resample

CASES = {"a": "prompt_24k.wav", "b": "prompt_16k.wav"}  # fixture README §3: the two cases of every set


def _maxabs(x: torch.Tensor, ref: np.ndarray) -> float:
    assert tuple(x.shape) == ref.shape, (tuple(x.shape), ref.shape)
    return float(np.abs(x.detach().cpu().numpy().astype(np.float64) - ref).max())


@pytest.fixture(scope="module")
def fe(golden):
    return golden("frontend")


@pytest.fixture(scope="module")
def tokenizer(parity_model_dir):
    return SpeechTokenizerOnnx(parity_model_dir / SPEECH_TOKENIZER_FILE, prefer_cuda=False)


@pytest.fixture(scope="module")
def speaker(parity_model_dir):
    return SpeakerEncoderOnnx(parity_model_dir / SPEAKER_ENCODER_FILE)


# --- parity ----------------------------------------------------------------------------------


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_load_audio_matches_official(parity, fe, case):
    for sr in (16_000, 24_000):
        wave = load_audio(parity / CASES[case], sr)
        assert wave.dtype == torch.float32
        assert within(_maxabs(wave, fe[f"{case}_speech_{sr // 1000}k"]), AUDIO_ATOL, f"{sr} Hz")


@pytest.mark.parity
def test_load_audio_from_bytes_equals_path(parity):
    path = parity / CASES["a"]
    assert torch.equal(load_audio(path.read_bytes(), 16_000), load_audio(path, 16_000))


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_whisper_log_mel(fe, case):
    logmel = whisper_log_mel(torch.from_numpy(fe[f"{case}_speech_16k"]))
    assert within(_maxabs(logmel, fe[f"{case}_whisper_logmel"]), LOGMEL_ATOL)


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_kaldi_fbank_and_cmn(fe, case):
    fbank = kaldi_fbank(torch.from_numpy(fe[f"{case}_speech_16k"]))
    assert within(_maxabs(fbank, fe[f"{case}_kaldi_fbank"]), FBANK_ATOL, "fbank")
    assert within(_maxabs(cmn(fbank), fe[f"{case}_kaldi_fbank_cmn"]), FBANK_ATOL, "cmn")


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_prompt_mel(fe, parity_model_dir, case):
    feat = load_hparams(parity_model_dir).feat
    mel = prompt_mel(torch.from_numpy(fe[f"{case}_speech_24k"]), feat)
    assert within(_maxabs(mel, fe[f"{case}_prompt_mel_24k_raw"]), FBANK_ATOL)


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_speech_tokens(fe, tokenizer, case):
    ref = fe[f"{case}_speech_token_raw"]
    tokens = tokenizer(torch.from_numpy(fe[f"{case}_whisper_logmel"]))
    assert tokens.dtype == torch.int32 and tokens.shape == ref.shape
    np.testing.assert_array_equal(tokens.numpy(), ref)  # golden log-mel in: exact
    own = tokenizer(whisper_log_mel(torch.from_numpy(fe[f"{case}_speech_16k"])))
    agreement = float((own.numpy() == ref).mean())
    print(f"{case}: own-feature token agreement {100 * agreement:.1f}%")
    assert at_least(agreement, OWN_TOKEN_AGREEMENT)  # README: a few % may flip with own features


@pytest.mark.parity
def test_tokenizer_raw_output_facts(fe, tokenizer):
    """The stand-in returns int64 [1, T'], T' = ceil(ceil(T/2)/2); the wrapper flattens and casts to int32."""
    raw = fe["a_speech_tokenizer_onnx_output"]
    logmel = fe["a_whisper_logmel"]
    assert raw.dtype == np.int64 and raw.shape == (1, math.ceil(math.ceil(logmel.shape[2] / 2) / 2))
    lengths = np.array([logmel.shape[2]], np.int32)
    out = tokenizer.session.run(None, {"feats": logmel, "feats_length": lengths})
    np.testing.assert_array_equal(out[0], raw)
    np.testing.assert_array_equal(tokenizer(torch.from_numpy(logmel)).numpy(), raw.astype(np.int32))


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_speaker_embedding(fe, speaker, case):
    ref = fe[f"{case}_spk_embedding"]
    emb = speaker(torch.from_numpy(fe[f"{case}_kaldi_fbank_cmn"]))
    assert emb.dtype == torch.float32 and emb.shape == (1, 192)
    assert within(_maxabs(emb, ref), XVECTOR_ATOL, "golden fbank")
    own = speaker(cmn(kaldi_fbank(torch.from_numpy(fe[f"{case}_speech_16k"]))))
    assert within(_maxabs(own, ref), OWN_XVECTOR_ATOL, "own fbank")


@pytest.mark.parity
def test_full_chain_from_file(parity, fe, tokenizer, speaker, parity_model_dir):
    """File -> every frontend feature, as the official frontend chains them (case a). Tokens from our
    own log-mel are held to the README's agreement, not to equality: a log-mel within LOGMEL_ATOL
    may still move a value across a tokenizer rounding edge on another CPU's FFT."""
    feat = load_hparams(parity_model_dir).feat
    s16, s24 = load_audio(parity / CASES["a"], 16_000), load_audio(parity / CASES["a"], 24_000)
    tokens = tokenizer(whisper_log_mel(s16)).numpy()
    assert tokens.shape == fe["a_speech_token_raw"].shape
    assert at_least((tokens == fe["a_speech_token_raw"]).mean(), OWN_TOKEN_AGREEMENT)
    assert within(_maxabs(speaker(cmn(kaldi_fbank(s16))), fe["a_spk_embedding"]), OWN_XVECTOR_ATOL, "x-vector")
    assert within(_maxabs(prompt_mel(s24, feat), fe["a_prompt_mel_24k_raw"]), FBANK_ATOL, "prompt mel")


# --- loading ---------------------------------------------------------------------------------


def _wav(samples: np.ndarray, sr: int, subtype: str = "PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, sr, format="WAV", subtype=subtype)
    return buf.getvalue()


def test_int16_wav_reads_as_int_over_32768():
    pcm = np.array([-32768, -1, 0, 1, 12345, 32767], dtype=np.int16)
    wave = load_audio(_wav(pcm, 16_000), 16_000)
    np.testing.assert_array_equal(wave.numpy()[0], pcm.astype(np.float32) / 32768)


def test_stereo_is_channel_mean():
    rng = np.random.default_rng(0)
    stereo = (rng.standard_normal((1600, 2)) * 0.1).astype(np.float32)
    wave = load_audio(_wav(stereo, 16_000, "FLOAT"), 16_000)
    assert wave.shape == (1, 1600)
    np.testing.assert_allclose(wave.numpy()[0], stereo.mean(axis=1), atol=1e-7)


@pytest.mark.parametrize("orig_sr", [8_000, 22_050, 44_100, 48_000])
def test_resample_length_is_ceil(orig_sr):
    for n in (1, 999, 12_345):
        out = resample(torch.zeros(1, n), orig_sr, 16_000)
        assert out.shape == (1, math.ceil(n * 16_000 / orig_sr))


def test_resample_keeps_batch_dims():
    out = resample(torch.zeros(2, 3, 480), 48_000, 16_000)
    assert out.shape == (2, 3, 160)


@pytest.mark.parametrize(("orig_sr", "new_sr"), [(48_000, 16_000), (8_000, 24_000), (24_000, 16_000)])
def test_resample_reproduces_a_sine(orig_sr, new_sr):
    f_hz, seconds = 440.0, 0.5
    t_in = torch.arange(int(orig_sr * seconds), dtype=torch.float64) / orig_sr
    out = resample(torch.sin(2 * math.pi * f_hz * t_in).float()[None], orig_sr, new_sr)[0]
    t_out = torch.arange(out.shape[0], dtype=torch.float64) / new_sr
    ref = torch.sin(2 * math.pi * f_hz * t_out)
    inner = slice(new_sr // 50, -new_sr // 50)  # skip 20 ms edges (zero padding)
    assert (out[inner].double() - ref[inner]).abs().max() < 1e-3  # measured 2-4e-4 (the filter's ripple)


def test_load_audio_resamples_low_rates():
    wave = load_audio(_wav(np.zeros(8_001, np.int16), 8_000), 16_000)
    assert wave.shape == (1, 16_002)


def test_audio_errors_name_the_input(tmp_path):
    with pytest.raises(AudioError, match="not found"):
        load_audio(tmp_path / "missing.wav", 16_000)
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    with pytest.raises(AudioError, match=r"empty\.wav"):
        load_audio(empty, 16_000)
    corrupt = tmp_path / "corrupt.wav"
    corrupt.write_bytes(b"RIFF\x10\x00\x00\x00WAVEjunkjunkjunk" + bytes(range(64)))
    with pytest.raises(AudioError, match=r"corrupt\.wav"):
        load_audio(corrupt, 16_000)
    with pytest.raises(AudioError):
        load_audio(b"this is not audio at all" * 10, 16_000)
    assert issubclass(AudioError, ValueError)


def test_webm_without_pyav_says_what_is_needed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # an install without PyAV (it is a requirement now): import fails
    webm = tmp_path / "voice.webm"
    webm.write_bytes(b"\x1a\x45\xdf\xa3" + bytes(200))
    with pytest.raises(AudioError, match=r"voice\.webm.*WebM.*PyAV"):
        load_audio(webm, 16_000)


def test_pyav_fallback_path(tmp_path, monkeypatch):
    """Formats libsndfile refuses go to PyAV when importable (a fake `av` here: s16 packed stereo)."""
    import sys
    import types

    class FakeFrame:
        format = types.SimpleNamespace(is_planar=False, name="s16")
        layout = types.SimpleNamespace(channels=("FL", "FR"))

        def __init__(self, pcm):  # pcm [n, 2] int16
            self.pcm = pcm

        def to_ndarray(self):
            return self.pcm.reshape(1, -1)  # packed: interleaved L R L R ...

    pcm = np.array([[1000, 3000], [-32768, 32767], [0, 2]], dtype=np.int16)
    stream = types.SimpleNamespace(codec_context=types.SimpleNamespace(sample_rate=8_000))

    class FakeContainer:
        streams = types.SimpleNamespace(audio=[stream])

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def decode(self, _stream):
            return [FakeFrame(pcm[:2]), FakeFrame(pcm[2:])]

    class FFmpegError(Exception):
        pass

    demuxers = []  # what each open forced: never a probed format (an upload posing as a playlist)
    av = types.ModuleType("av")
    av.open = lambda _f, format=None: demuxers.append(format) or FakeContainer()
    av.error = types.ModuleType("av.error")
    av.error.FFmpegError = FFmpegError
    monkeypatch.setitem(sys.modules, "av", av)
    monkeypatch.setitem(sys.modules, "av.error", av.error)
    clip = tmp_path / "clip.m4a"
    clip.write_bytes(b"\x00\x00\x00\x20ftypM4A " + bytes(64))
    wave = load_audio(clip, 8_000)
    np.testing.assert_allclose(wave.numpy()[0], pcm.astype(np.float32).mean(axis=1) / 32768, atol=1e-7)
    assert load_audio(clip, 16_000).shape == (1, 6)
    assert demuxers == ["mov", "mov"]


# --- int16 / WAV encoding ---------------------------------------------------------------------


def test_int16_fixed_scale():
    x = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -3.0, 1e-4], dtype=np.float32)
    pcm = to_int16_pcm(x)
    assert pcm.dtype == np.dtype("<i2")
    np.testing.assert_array_equal(pcm, [0, 16384, -16384, 32767, -32767, 32767, -32767, 3])
    # no peak normalisation: a quiet signal stays quiet
    assert np.abs(to_int16_pcm(torch.full((10,), 0.01))).max() == 328


def test_wav_bytes_round_trip():
    rng = np.random.default_rng(1)
    x = np.clip(rng.standard_normal(2400) * 0.2, -1, 1).astype(np.float32)
    data = wav_bytes(torch.from_numpy(x)[None], 24_000)
    back, sr = sf.read(io.BytesIO(data), dtype="int16")
    assert sr == 24_000 and back.ndim == 1
    np.testing.assert_array_equal(back, to_int16_pcm(x))
    info = sf.info(io.BytesIO(data))
    assert info.subtype == "PCM_16" and info.channels == 1
    # and it loads back through our loader within one int16 step
    assert np.abs(load_audio(data, 24_000).numpy()[0] - x).max() <= 1 / 32767


# --- features / ONNX edge cases --------------------------------------------------------------


def test_feature_shapes():
    x = torch.zeros(1, 16_000)
    assert whisper_log_mel(x).shape == (1, 128, 100)
    assert kaldi_fbank(x).shape == (1 + (16_000 - 400) // 160, 80)
    with pytest.raises(ValueError, match="400"):
        kaldi_fbank(torch.zeros(1, 399))
    with pytest.raises(ValueError, match="mono"):
        whisper_log_mel(torch.zeros(2, 16_000))


def test_make_session_errors_name_the_file(tmp_path):
    with pytest.raises(ModelFolderError, match=r"nothere\.onnx"):
        make_session(tmp_path / "nothere.onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a protobuf" * 8)
    with pytest.raises(ModelFolderError, match=r"bad\.onnx"):
        make_session(bad)


@pytest.mark.gpu
def test_features_on_cuda_match_cpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x = torch.randn(1, 32_000, generator=torch.Generator().manual_seed(0)) * 0.1
    for fn in (whisper_log_mel, kaldi_fbank, lambda w: resample(w, 16_000, 24_000)):
        cpu, gpu = fn(x), fn(x.cuda())
        assert gpu.is_cuda and (gpu.cpu() - cpu).abs().max() < 1e-3
