"""Forced alignment of known text to its audio with Whisper's cross-attention (pure model code, no serving).

The sentence's tokens are fed to the decoder (teacher forcing, no decoding), so every token gets a time and
no recognition error can enter; the cross-attention of the alignment heads says where in the audio each
token was predicted from, and dynamic time warping makes that a monotone token -> frame path.
Design notes and the choice of aligner: docs/timings.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from app.audio import SILENCE_DBFS, frame_levels_dbfs
from app.model.asr import ASR_SAMPLE_RATE_HZ, WhisperAsr
from app.model.words import WordSpan, language_of, split_words, word_frames
from app.resample import resample

SECONDS_PER_FRAME = 0.02  # one encoder frame = 2 mel hops of 10 ms
SAMPLES_PER_FRAME = round(ASR_SAMPLE_RATE_HZ * SECONDS_PER_FRAME)  # 320 at 16 kHz
MAX_ALIGN_SECONDS = 30.0  # Whisper hears one 30 s window
MEDIAN_WIDTH = 7  # frames: the median filter over each head's attention (Whisper's own width)


@dataclass(frozen=True)
class AlignedWords:
    """One sentence's words and where the aligner put them, in seconds from the sentence's first sample."""

    words: tuple[WordSpan, ...]
    start_s: tuple[float, ...]  # [W]; NaN where the aligner gave the word no token (then end_s is NaN too)
    end_s: tuple[float, ...]  # [W]
    duration_s: float  # the sentence's audio
    speech_s: tuple[float, float]  # [start, end) of the frames above SILENCE_DBFS (the whole audio if none)
    note: str = ""  # why nothing was aligned ("" when the aligner ran)


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cheapest monotone path through `cost` [R, F] from (0, 0) to (R-1, F-1) -> (rows [P], cols [P]).

    Steps: diagonal, down (next row, same frame) or right (same row, next frame). Each row's recursion
    D[i, j] = c[i, j] + min(D[i-1, j-1], D[i-1, j], D[i, j-1]) is solved at once as a running minimum
    over prefix sums: D[i, j] = S[j] + min_{k<=j}(A[k] - S[k-1]), A[k] = min(D[i-1, k-1], D[i-1, k]).
    """
    n_rows, n_cols = cost.shape
    acc = np.empty((n_rows, n_cols))  # [R, F] float64 cumulative cost
    acc[0] = np.cumsum(cost[0])
    for i in range(1, n_rows):
        above = acc[i - 1]
        enter = np.minimum(above, np.concatenate([[np.inf], above[:-1]]))  # [F] A[k]
        s = np.cumsum(cost[i])
        s_prev = np.concatenate([[0.0], s[:-1]])
        acc[i] = s + np.minimum.accumulate(enter - s_prev)
    i, j = n_rows - 1, n_cols - 1
    path = [(i, j)]
    while i > 0 or j > 0:
        if i == 0:
            j -= 1
        elif j == 0:
            i -= 1
        else:  # ties go diagonal, then down
            step = int(np.argmin([acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]]))
            i, j = (i - 1, j - 1) if step == 0 else (i - 1, j) if step == 1 else (i, j - 1)
        path.append((i, j))
    rows, cols = np.array(path[::-1]).T
    return rows, cols


def median_filter(x: np.ndarray, width: int) -> np.ndarray:
    """Median over the last axis in windows of `width` (odd), edges repeated: [..., F] -> [..., F]."""
    pad = width // 2
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)], mode="edge")
    return np.median(np.lib.stride_tricks.sliding_window_view(padded, width, axis=-1), axis=-1)


class WhisperAligner:
    """A Whisper with eager attention (the only kind that returns attention weights); `align` is blocking."""

    def __init__(self, asr: WhisperAsr) -> None:
        self.asr, self.model, self.tokenizer = asr, asr.model, asr.processor.tokenizer
        self.model.set_attn_implementation("eager")  # sdpa returns no weights
        gen, cfg = self.model.generation_config, self.model.config
        heads = getattr(gen, "alignment_heads", None)
        # a checkpoint without alignment heads (a tiny test model): every head of the later half of the layers,
        # the layers Whisper's own alignment heads come from
        self.heads = [tuple(h) for h in heads] if heads else [
            (layer, h) for layer in range(cfg.decoder_layers // 2, cfg.decoder_layers)
            for h in range(cfg.decoder_attention_heads)]
        self.prompt_head = [gen.decoder_start_token_id]  # then <|lang|> <|transcribe|> <|notimestamps|>
        self.task_ids = [gen.task_to_id["transcribe"], gen.no_timestamps_token_id]

    @classmethod
    def load(cls, folder: str | Path, device: str = "auto") -> WhisperAligner:
        """Load a Whisper checkpoint folder (as WhisperAsr.load: `AsrModelError` if it cannot)."""
        return cls(WhisperAsr.load(folder, device))

    @torch.inference_mode()
    def align(self, samples: np.ndarray, sample_rate: int, text: str, language: str = "") -> AlignedWords:
        """Where each word of `text` is spoken in `samples` ([N] float mono at `sample_rate`).

        `language` "" = guessed from the script (words.language_of). A sentence longer than MAX_ALIGN_SECONDS
        or with more tokens than the decoder holds, or an unknown language, is not aligned (`note` says why).
        """
        words = tuple(split_words(text))
        wave = resample(torch.from_numpy(np.asarray(samples, np.float32)), sample_rate, ASR_SAMPLE_RATE_HZ)
        duration_s = wave.numel() / ASR_SAMPLE_RATE_HZ
        n_frames = min(-(-wave.numel() // SAMPLES_PER_FRAME), round(MAX_ALIGN_SECONDS / SECONDS_PER_FRAME))
        first, last = _speech_frames(wave.numpy(), n_frames)
        none = AlignedWords(words, (np.nan,) * len(words), (np.nan,) * len(words), duration_s,
                            (first * SECONDS_PER_FRAME, min(duration_s, last * SECONDS_PER_FRAME)))
        lang_id = self.model.generation_config.lang_to_id.get(f"<|{language or language_of(text)}|>")
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, chars = enc.input_ids, enc.offset_mapping  # [T] token ids, [T] (start, end) characters
        prompt = [*self.prompt_head, lang_id, *self.task_ids]
        room = self.model.config.max_target_positions - len(prompt)
        why = _why_not(words, duration_s, len(ids), room, lang_id, language, n_frames)
        if why:
            return replace(none, note=why)
        starts = self._token_starts(wave, prompt, ids, first, last)  # [T + 1] frames, the last is <|endoftext|>
        frames = word_frames(words, chars, np.stack([starts[:-1], starts[1:]], axis=1))  # [W, 2]
        return AlignedWords(words, tuple(frames[:, 0] * SECONDS_PER_FRAME), tuple(frames[:, 1] * SECONDS_PER_FRAME),
                            duration_s, none.speech_s)

    def _token_starts(self, wave: torch.Tensor, prompt: list[int], ids: list[int], first: int,
                      last: int) -> np.ndarray:
        """The frame where each text token (and <|endoftext|>) begins on the DTW path -> [T + 1] float."""
        feats = self.asr.processor.feature_extractor(wave.numpy(), sampling_rate=ASR_SAMPLE_RATE_HZ,
                                                     return_tensors="pt")  # padded to the 30 s window
        features = feats.input_features.to(self.asr.device, self.asr.dtype)  # [1, n_mels, 3000]
        dec = torch.tensor([prompt + ids], device=self.asr.device)  # [1, P + T]
        out = self.model(input_features=features, decoder_input_ids=dec, output_attentions=True)
        # the query at position p predicts token p + 1: rows P-1 .. P+T-1 are the T text tokens and <|endoftext|>
        attn = torch.stack([out.cross_attentions[layer][0, h] for layer, h in self.heads])  # [K, P + T, 1500]
        w = attn[:, len(prompt) - 1:, first:last].float().cpu().numpy()  # [K, T + 1, F] the speech frames
        w = (w - w.mean(axis=1, keepdims=True)) / (w.std(axis=1, keepdims=True) + 1e-8)  # per frame, over tokens
        matrix = median_filter(w, MEDIAN_WIDTH).mean(axis=0)  # [T + 1, F]
        rows, cols = dtw(-matrix)
        starts = np.zeros(len(ids) + 1)
        starts[rows[::-1]] = cols[::-1]  # written last-to-first: each row keeps its first frame
        return starts + first


def _why_not(words: tuple[WordSpan, ...], duration_s: float, n_tokens: int, room: int, lang_id: int | None,
             language: str, n_frames: int) -> str:
    """Why this sentence cannot be aligned ("" when it can)."""
    if not words:
        return "no words"
    if duration_s > MAX_ALIGN_SECONDS:
        return f"{duration_s:.1f} s is longer than Whisper's {MAX_ALIGN_SECONDS:.0f} s window"
    if n_tokens > room:
        return f"{n_tokens} tokens, more than the decoder's {room}"
    if lang_id is None:
        return f"Whisper has no language {language!r}"
    return "no audio" if n_frames == 0 else ""


def _speech_frames(wave: np.ndarray, n_frames: int) -> tuple[int, int]:
    """[first, last) encoder frames above SILENCE_DBFS among the first `n_frames` (all of them if none are)."""
    loud = np.flatnonzero(frame_levels_dbfs(wave, ASR_SAMPLE_RATE_HZ)[:n_frames] >= SILENCE_DBFS)
    return (int(loud[0]), int(loud[-1]) + 1) if loud.size else (0, n_frames)
