"""Frontend: text -> normalised segments -> token ids; prompt audio -> `VoiceFeatures`.

Design notes: docs/model.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from app.audio import (
    CLIP_WARN_FRACTION,
    LEVEL_FRAME_SECONDS,
    MAX_PROMPT_SECONDS,
    MIN_PROMPT_SECONDS,
    MIN_SOUND_SECONDS,
    OUTPUT_SAMPLE_RATE_HZ,
    PROMPT_SAMPLE_RATE_HZ,
    SILENCE_DBFS,
    busiest_window,
    clipped_fraction,
    decode_audio,
    frame_levels_dbfs,
    resample_rates,
)
from app.message import Message
from app.model.features import cmn, kaldi_fbank, prompt_mel, whisper_log_mel
from app.model.flow_calls import FlowPrompt
from app.model.hparams import FeatDims
from app.model.onnx_models import SpeakerEncoderOnnx, SpeechTokenizerOnnx
from app.model.text import TextFrontend, is_only_punctuation
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
    notes: tuple[str, ...] = ()  # what the reference checks changed or warn about (trimmed, clipped); not saved

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


def _too_short(seconds: float) -> PromptAudioError:
    return PromptAudioError(Message("too_short", "the reference clip is {seconds:.2f} s long; it must be at least "
                                    "{min:.0f} s (3-10 s of clear speech work best)", seconds=seconds,
                                    min=MIN_PROMPT_SECONDS))


def check_reference(wave: Tensor, sample_rate: int, prompt_text: str) -> tuple[Tensor, tuple[str, ...]]:
    """The usable part of a reference clip `[1, N]` (mono, at its own `sample_rate`) and notes for the user.

    Refused (`PromptAudioError`): shorter than MIN_PROMPT_SECONDS; silent or almost silent (less than
    MIN_SOUND_SECONDS above SILENCE_DBFS); longer than MAX_PROMPT_SECONDS *with* a transcript (the
    words must match the audio the LM sees). Without a transcript a long clip is cut to its busiest
    MAX_PROMPT_SECONDS window. Heavily clipped clips are kept with a note (CLIP_WARN_FRACTION).
    """
    x = wave[0].float().numpy()  # [N]
    seconds = x.shape[0] / sample_rate
    if seconds < MIN_PROMPT_SECONDS:
        raise _too_short(seconds)
    levels = frame_levels_dbfs(x, sample_rate)  # [F] dBFS per 20 ms
    frame_len = max(1, round(sample_rate * LEVEL_FRAME_SECONDS))  # samples per level frame
    frame_s = frame_len / sample_rate
    loudest = float(levels.max())
    if loudest < SILENCE_DBFS:
        level = "all samples are zero" if loudest <= -199 else f"its loudest part is at {loudest:.0f} dBFS"
        raise PromptAudioError(Message("silent", "the reference clip is silent ({level}; speech needs at least "
                                       "{dbfs:.0f} dBFS): check the microphone and record again", level=level,
                                       dbfs=SILENCE_DBFS))
    sound_s = float((levels >= SILENCE_DBFS).sum()) * frame_s
    if sound_s < MIN_SOUND_SECONDS:
        raise PromptAudioError(Message("almost_silent", "the reference clip is almost silent: only {sound:.2f} s is "
                                       "louder than {dbfs:.0f} dBFS; record at least {min} s of speech",
                                       sound=sound_s, dbfs=SILENCE_DBFS, min=MIN_SOUND_SECONDS))
    notes = []
    if seconds > MAX_PROMPT_SECONDS:
        if prompt_text.strip():
            raise PromptAudioError(Message(
                "too_long_with_transcript", "the reference clip is {seconds:.1f} s; the limit is {limit:.0f} s. Trim "
                "it to the part whose words you typed, or clear the transcript to use its best {limit:.0f} s "
                "(cross-lingual mode)", seconds=seconds, limit=MAX_PROMPT_SECONDS))
        n_frames = int(MAX_PROMPT_SECONDS * sample_rate) // frame_len  # the window, <= MAX_PROMPT_SECONDS
        start = busiest_window(levels, n_frames)
        x = x[start * frame_len: (start + n_frames) * frame_len]
        notes.append(Message("trimmed", "the reference clip is {seconds:.1f} s, over the {limit:.0f} s limit: its "
                             "{start:.1f}-{end:.1f} s part (the most speech) was used", seconds=seconds,
                             limit=MAX_PROMPT_SECONDS, start=start * frame_s, end=(start + n_frames) * frame_s))
    clipped = clipped_fraction(x)
    if clipped >= CLIP_WARN_FRACTION:
        notes.append(Message("clipped", "the reference clip is heavily clipped ({share:.1%} of samples at the peak): "
                             "the voice may sound distorted; record at a lower input level", share=clipped))
    return torch.from_numpy(np.ascontiguousarray(x))[None], tuple(notes)


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
                         normalize: bool = True, notes: tuple[str, ...] = ()) -> VoiceFeatures:
        """Features of a reference recording given at both rates ([1, N] float32 each)."""
        seconds = wave_16k.shape[1] / PROMPT_SAMPLE_RATE_HZ
        if seconds < MIN_PROMPT_SECONDS:
            raise _too_short(seconds)
        text = self.normalize_prompt_text(prompt_text) if normalize else prompt_text
        mel = self.prompt_mel(wave_24k)
        tokens = self.speech_tokens(wave_16k)
        n = min(mel.shape[1] // 2, tokens.shape[1])  # align: mel frames == 2 x tokens
        if n < 1:
            raise PromptAudioError("reference audio is too short to give a single speech token")
        return VoiceFeatures(prompt_text=text, prompt_text_ids=self.text_ids(text),
                             speech_tokens=tokens[:, :n].to(torch.int32).cpu(),
                             speech_mel=mel[:, : 2 * n].float().cpu(),
                             embedding=self.speaker_embedding(wave_16k).float().cpu(), notes=notes)

    def voice_from_audio(self, src: str | Path | bytes, prompt_text: str) -> VoiceFeatures:
        """Features of a reference recording in any readable format, rate and channel count.

        Raises `AudioError` (cannot decode) or `PromptAudioError` (unusable: see `check_reference`);
        the returned features' `notes` say what was trimmed or looks wrong.
        """
        chans, sr = decode_audio(src)  # [C, N] at the file's rate
        mono, notes = check_reference(chans.mean(dim=0, keepdim=True), sr, prompt_text)  # [1, N']
        wave_16k, wave_24k = resample_rates(mono, sr, (PROMPT_SAMPLE_RATE_HZ, OUTPUT_SAMPLE_RATE_HZ))
        return self.voice_from_waves(wave_16k, wave_24k, prompt_text, notes=notes)
