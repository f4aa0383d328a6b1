"""Frontend: text -> normalised segments -> token ids; prompt audio -> `VoiceFeatures`.

Reproduces the official `CosyVoiceFrontEnd` for 24 kHz models (cosyvoice_internals.md §2):
speech tokens from a whisper-style 128-bin log-mel of the 16 kHz prompt (ONNX tokenizer),
CAM++ x-vector from Kaldi fbank + CMN of the 16 kHz prompt, an 80-bin log-mel of the 24 kHz
prompt, then mel frames and tokens truncated so that mel == 2 x tokens.

`VoiceFeatures` is an immutable value: compute it once per reference recording and reuse it
for every request with that voice (a saved voice skips all of this).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from app.audio import (
    MAX_PROMPT_SECONDS,
    MIN_PROMPT_SECONDS,
    OUTPUT_SAMPLE_RATE_HZ,
    PROMPT_SAMPLE_RATE_HZ,
    load_audio_rates,
)
from app.model.features import cmn, kaldi_fbank, prompt_mel, whisper_log_mel
from app.model.hparams import FeatDims
from app.model.onnx_models import SpeakerEncoderOnnx, SpeechTokenizerOnnx
from app.model.text import TextFrontend, is_only_punctuation
from app.model.token2wav import FlowPrompt
from app.model.tokenizer import SpeechTextTokenizer

_ARRAY_KEYS = ("prompt_text_ids", "speech_tokens", "speech_mel", "embedding")


class PromptAudioError(ValueError):
    """The reference recording cannot be used; the message says what to change."""


@dataclass(frozen=True)
class VoiceFeatures:
    """Everything the LM and the flow need about one reference voice (CPU tensors)."""

    prompt_text: str  # normalised transcript of the reference recording
    prompt_text_ids: Tensor  # [Lp] int32 text token ids of prompt_text
    speech_tokens: Tensor  # [1, P] int32 speech tokens (25 Hz)
    speech_mel: Tensor  # [1, 2P, 80] float32 log-mel at 24 kHz (50 Hz)
    embedding: Tensor  # [1, 192] float32 CAM++ x-vector (only the flow uses it)

    def __post_init__(self) -> None:
        p = self.speech_tokens.shape[1]
        assert self.speech_mel.shape[1] == 2 * p, (self.speech_mel.shape, p)

    @property
    def n_prompt_tokens(self) -> int:
        return int(self.speech_tokens.shape[1])

    def flow_prompt(self, device: torch.device | str = "cpu") -> FlowPrompt:
        return FlowPrompt(tokens=self.speech_tokens.to(device), mel=self.speech_mel.to(device),
                          embedding=self.embedding.to(device))

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Plain arrays (for `np.savez`; no pickle). The text goes as a uint8 UTF-8 array."""
        out = {k: getattr(self, k).cpu().numpy() for k in _ARRAY_KEYS}
        out["prompt_text_utf8"] = np.frombuffer(self.prompt_text.encode("utf-8"), dtype=np.uint8)
        return out

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> VoiceFeatures:
        text = bytes(np.asarray(arrays["prompt_text_utf8"], dtype=np.uint8)).decode("utf-8")
        t = {k: torch.from_numpy(np.array(arrays[k])) for k in _ARRAY_KEYS}
        return cls(prompt_text=text, prompt_text_ids=t["prompt_text_ids"].to(torch.int32),
                   speech_tokens=t["speech_tokens"].to(torch.int32),
                   speech_mel=t["speech_mel"].float(), embedding=t["embedding"].float())


class Frontend:
    """Text normalisation/tokenisation and reference-audio features. Thread-safe, shareable."""

    def __init__(self, tokenizer: SpeechTextTokenizer, text: TextFrontend, speech_tokenizer: SpeechTokenizerOnnx,
                 speaker_encoder: SpeakerEncoderOnnx, feat: FeatDims, *, text_frontend: bool = True) -> None:
        self.tokenizer, self.text, self.feat = tokenizer, text, feat
        self.speech_tokenizer, self.speaker_encoder = speech_tokenizer, speaker_encoder
        self.text_frontend = text_frontend

    # --- text --------------------------------------------------------------------------------

    def split_text(self, text: str) -> list[str]:
        """Normalised segments of the text to speak; each is synthesised on its own."""
        segments = self.text.normalize(text, split=True, text_frontend=self.text_frontend)
        return [s for s in segments if s.strip() and not is_only_punctuation(s)]

    def normalize_prompt_text(self, text: str) -> str:
        return str(self.text.normalize(text, split=False, text_frontend=self.text_frontend))

    def text_ids(self, text: str) -> Tensor:
        """[L] int32 token ids (no BOS/EOS)."""
        return torch.tensor(self.tokenizer.encode(text), dtype=torch.int32)

    # --- audio -------------------------------------------------------------------------------

    def speech_tokens(self, wave_16k: Tensor) -> Tensor:
        """[1, N] 16 kHz -> [1, P] int32 speech tokens."""
        seconds = wave_16k.shape[1] / PROMPT_SAMPLE_RATE_HZ
        if seconds > MAX_PROMPT_SECONDS:
            raise PromptAudioError(
                f"reference audio is {seconds:.1f} s; the speech tokenizer accepts at most "
                f"{MAX_PROMPT_SECONDS:.0f} s: trim it")
        return self.speech_tokenizer(whisper_log_mel(wave_16k, n_mels=128))

    def speaker_embedding(self, wave_16k: Tensor) -> Tensor:
        """[1, N] 16 kHz -> [1, 192] x-vector."""
        return self.speaker_encoder(cmn(kaldi_fbank(wave_16k, num_mel_bins=80)))

    def prompt_mel(self, wave_24k: Tensor) -> Tensor:
        """[1, N] 24 kHz -> [1, T, 80] log-mel."""
        return prompt_mel(wave_24k, self.feat)

    def voice_from_waves(self, wave_16k: Tensor, wave_24k: Tensor, prompt_text: str, *,
                         normalize: bool = True) -> VoiceFeatures:
        """Features of a reference recording given at both rates ([1, N] float32 each)."""
        seconds = wave_16k.shape[1] / PROMPT_SAMPLE_RATE_HZ
        if seconds < MIN_PROMPT_SECONDS:
            raise PromptAudioError(f"reference audio is {seconds:.2f} s long; record at least a few seconds")
        text = self.normalize_prompt_text(prompt_text) if normalize else prompt_text
        mel = self.prompt_mel(wave_24k)
        tokens = self.speech_tokens(wave_16k)
        n = min(mel.shape[1] // 2, tokens.shape[1])  # align: mel frames == 2 x tokens
        if n < 1:
            raise PromptAudioError("reference audio is too short to give a single speech token")
        return VoiceFeatures(prompt_text=text, prompt_text_ids=self.text_ids(text),
                             speech_tokens=tokens[:, :n].to(torch.int32).cpu(),
                             speech_mel=mel[:, : 2 * n].float().cpu(),
                             embedding=self.speaker_embedding(wave_16k).float().cpu())

    def voice_from_audio(self, src: str | Path | bytes, prompt_text: str) -> VoiceFeatures:
        """Features of a reference recording in any readable format, rate and channel count."""
        wave_16k, wave_24k = load_audio_rates(src, (PROMPT_SAMPLE_RATE_HZ, OUTPUT_SAMPLE_RATE_HZ))
        return self.voice_from_waves(wave_16k, wave_24k, prompt_text)
