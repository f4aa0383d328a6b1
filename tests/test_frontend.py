"""The composed zero-shot frontend (`Frontend.voice_from_audio`) against frontend_zero_shot goldens."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tolerances import FBANK_ATOL, OWN_TOKEN_AGREEMENT, OWN_XVECTOR_ATOL, at_least, within

from app.model.loader import load_model

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def frontend(parity_model_dir):
    return load_model(parity_model_dir, device="cpu").frontend


@pytest.mark.parametrize("case,wav", [("a", "prompt_24k.wav"), ("b", "prompt_16k.wav")])
def test_zero_shot_voice_features(frontend, parity, golden, manifest, case, wav):
    g = golden("frontend")
    voice = frontend.voice_from_audio(parity / wav, manifest["e2e"]["prompt_text"])
    assert voice.prompt_text == manifest["e2e"]["normalized_prompt_text"]
    assert np.array_equal(voice.prompt_text_ids.numpy(), g[f"{case}_zs_prompt_text"][0])
    # the length alignment is exact; the tokens come from our own log-mel (README: a few % may flip)
    want = g[f"{case}_zs_prompt_speech_token"]
    assert voice.speech_tokens.shape == want.shape
    assert at_least((voice.speech_tokens.numpy() == want).mean(), OWN_TOKEN_AGREEMENT)
    assert within(np.abs(voice.speech_mel.numpy() - g[f"{case}_zs_prompt_speech_feat"]).max(), FBANK_ATOL, "mel")
    assert within(np.abs(voice.embedding.numpy() - g[f"{case}_zs_embedding"]).max(), OWN_XVECTOR_ATOL, "x-vector")
    assert voice.speech_mel.shape[1] == 2 * voice.speech_tokens.shape[1]


def test_tts_text_ids(frontend, golden, parity):
    """`a_zs_text` holds the ids of the set's English TTS text; text.json lists the texts it tokenised."""
    want = golden("frontend")["a_zs_text"][0].tolist()
    texts = [c["text"] for c in json.loads((parity / "text.json").read_text(encoding="utf-8"))["tokenize"]
             if c["ids"] == want]
    if not texts:
        pytest.skip("this fixture set's text.json does not list the text behind frontend.npz a_zs_text")
    assert frontend.text_ids(texts[0]).numpy().tolist() == want


def test_too_short_and_too_long_prompts(frontend):
    from app.model.frontend import PromptAudioError

    with pytest.raises(PromptAudioError, match="at least"):
        frontend.voice_from_waves(torch.zeros(1, 1000), torch.zeros(1, 1500), "hi")
    with pytest.raises(PromptAudioError, match="30 s"):
        frontend.voice_from_waves(torch.randn(1, 16000 * 31) * 0.1, torch.randn(1, 24000 * 31) * 0.1, "hi")
