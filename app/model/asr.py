"""Whisper speech recognition of reference clips, through `transformers` (pure model code, no serving).

Design notes: docs/model.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from app.audio import MAX_PROMPT_SECONDS, load_audio

ASR_SAMPLE_RATE_HZ = 16_000  # Whisper's input rate
MAX_ASR_SECONDS = MAX_PROMPT_SECONDS  # Whisper hears one 30 s window; a longer reference is cut, not transcribed
# the decoder prompt (<|startoftranscript|> <|lang|> <|transcribe|> <|notimestamps|>) plus headroom:
# prompt + new tokens must fit the decoder's max_target_positions (448 for every OpenAI checkpoint)
DECODER_PROMPT_TOKENS = 8
ASR_FILE_PATTERNS = ["*.json", "*.txt", "*.safetensors"]  # what from_pretrained reads (no .bin/.msgpack/.h5)


class AsrModelError(RuntimeError):
    """The Whisper folder cannot be loaded; the message names the folder and what is wrong."""


class AsrInputError(ValueError):
    """This clip cannot be transcribed (too long, undecodable); the message says why."""


@dataclass(frozen=True)
class Transcript:
    text: str  # the words, stripped ("" when Whisper heard none)
    language: str  # Whisper language code: "en", "zh", ... (detected, or the one asked for)


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when a GPU is visible, else "cpu"; anything else unchanged."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def fetch_asr_model(model_id: str, *, download: bool, report: Callable[[int, int], None] | None = None) -> Path:
    """The checkpoint folder of `model_id`: a local folder as it is, else the Hugging Face cache, else (with
    `download`) huggingface_hub's snapshot. Raises `AsrModelError` saying why none is usable (offline, ...)."""
    folder = Path(model_id).expanduser()
    if folder.is_dir():
        return folder.resolve()
    from huggingface_hub import snapshot_download

    from app.model.source import progress_class

    with contextlib.suppress(OSError, ValueError):  # not (fully) cached: download below
        return Path(snapshot_download(model_id, allow_patterns=ASR_FILE_PATTERNS, local_files_only=True))
    if not download:
        raise AsrModelError(f"{model_id} is not in the Hugging Face cache and asr.download is off")
    try:
        tqdm = progress_class(report) if report is not None else None
        return Path(snapshot_download(model_id, allow_patterns=ASR_FILE_PATTERNS, tqdm_class=tqdm))
    except Exception as e:  # offline, DNS, HTTP errors, HF_HUB_OFFLINE=1: the caller falls back
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise AsrModelError(f"cannot download {model_id} ({first[:200]})") from e


class WhisperAsr:
    """A loaded Whisper model and its processor; `transcribe` is blocking (run it in a worker thread)."""

    def __init__(self, model, processor, device: str) -> None:
        self.model, self.processor, self.device = model, processor, device
        self.dtype = next(model.parameters()).dtype
        n_positions = model.config.max_target_positions
        self.max_new_tokens = max(1, n_positions - DECODER_PROMPT_TOKENS)
        self.languages = {tok.strip("<|>"): i for tok, i in (model.generation_config.lang_to_id or {}).items()}

    @classmethod
    def load(cls, folder: str | Path, device: str = "auto") -> WhisperAsr:
        """Load a Whisper checkpoint folder (float16 on a GPU, float32 on the CPU); `AsrModelError` if broken."""
        from transformers import WhisperForConditionalGeneration, WhisperProcessor

        folder, device = Path(folder), resolve_device(device)
        dtype = torch.float16 if device.startswith("cuda") else torch.float32
        try:
            processor = WhisperProcessor.from_pretrained(folder)
            model = WhisperForConditionalGeneration.from_pretrained(folder, dtype=dtype).to(device).eval()
        except Exception as e:  # transformers raises OSError, ValueError, JSON and safetensors errors alike
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise AsrModelError(f"the Whisper folder {folder} cannot be loaded ({first[:300]}); delete it to "
                                "download it again, or set [asr] model_id to a complete Whisper folder") from e
        if not model.generation_config.lang_to_id:
            raise AsrModelError(f"{folder} is an English-only Whisper (no language tokens): use a multilingual "
                                "one such as openai/whisper-large-v3-turbo")
        return cls(model, processor, device)

    @torch.inference_mode()
    def transcribe(self, src: str | Path | bytes, language: str = "") -> Transcript:
        """Words spoken in the clip `src` (path or bytes), greedy decoding; `language` "" = detect it.

        Raises `AsrInputError` for a clip longer than MAX_ASR_SECONDS or an unknown language code, and
        app.audio.AudioError for one that cannot be decoded.
        """
        wave = load_audio(src, ASR_SAMPLE_RATE_HZ)[0]  # [N] float32 mono at 16 kHz
        seconds = wave.numel() / ASR_SAMPLE_RATE_HZ
        if seconds > MAX_ASR_SECONDS:
            raise AsrInputError(f"the clip is {seconds:.1f} s long; Whisper transcribes at most "
                                f"{MAX_ASR_SECONDS:.0f} s: cut it or type its transcript")
        if language and language not in self.languages:
            raise AsrInputError(f"unknown Whisper language {language!r}: use a code such as en or zh")
        feats = self.processor.feature_extractor(wave.numpy(), sampling_rate=ASR_SAMPLE_RATE_HZ,
                                                 return_tensors="pt")  # padded to the 30 s window
        features = feats.input_features.to(self.device, self.dtype)  # [1, n_mels, 3000] log-mel, 100 fps
        if not language:
            lang_ids = self.model.detect_language(features)  # [1] the likeliest language token
            language = self.processor.tokenizer.decode(lang_ids[0]).strip("<|>")
        ids = self.model.generate(features, language=language, task="transcribe", do_sample=False,
                                  max_new_tokens=self.max_new_tokens)  # [1, T] without the decoder prompt
        text = self.processor.tokenizer.decode(ids[0], skip_special_tokens=True).strip()
        return Transcript(text=text, language=language)
