"""The composed zero-shot frontend (`Frontend.voice_from_audio`) against frontend_zero_shot goldens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.model.loader import load_model

pytestmark = pytest.mark.parity
TTS_TEXT_EN = "Parity tests keep our clean room implementation honest."


@pytest.fixture(scope="module")
def frontend(parity_model_dir):
    return load_model(parity_model_dir, device="cpu").frontend


@pytest.mark.parametrize("case,wav", [("a", "prompt_24k.wav"), ("b", "prompt_16k.wav")])
def test_zero_shot_voice_features(frontend, parity, golden, manifest, case, wav):
    g = golden("frontend")
    voice = frontend.voice_from_audio(parity / wav, manifest["e2e"]["prompt_text"])
    assert voice.prompt_text == manifest["e2e"]["normalized_prompt_text"]
    assert np.array_equal(voice.prompt_text_ids.numpy(), g[f"{case}_zs_prompt_text"][0])
    assert np.array_equal(voice.speech_tokens.numpy(), g[f"{case}_zs_prompt_speech_token"])
    np.testing.assert_allclose(voice.speech_mel.numpy(), g[f"{case}_zs_prompt_speech_feat"], atol=1e-3)
    np.testing.assert_allclose(voice.embedding.numpy(), g[f"{case}_zs_embedding"], atol=1e-4)
    assert voice.speech_mel.shape[1] == 2 * voice.speech_tokens.shape[1]


def test_tts_text_ids(frontend, golden):
    assert np.array_equal(frontend.text_ids(TTS_TEXT_EN).numpy(), golden("frontend")["a_zs_text"][0])


def test_too_short_and_too_long_prompts(frontend):
    from app.model.frontend import PromptAudioError

    with pytest.raises(PromptAudioError, match="at least"):
        frontend.voice_from_waves(torch.zeros(1, 1000), torch.zeros(1, 1500), "hi")
    with pytest.raises(PromptAudioError, match="30 s"):
        frontend.voice_from_waves(torch.randn(1, 16000 * 31) * 0.1, torch.randn(1, 24000 * 31) * 0.1, "hi")
