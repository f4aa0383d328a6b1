"""The two ONNX networks of the CosyVoice2 frontend, run with onnxruntime.

Design notes: docs/model.md.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from app.model.hparams import ModelFolderError

SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2.onnx"
SPEAKER_ENCODER_FILE = "campplus.onnx"
SPEAKER_EMBED_DIM = 192


def make_session(path: Path, *, prefer_cuda: bool = True,
                 intra_op_threads: int | None = None) -> ort.InferenceSession:
    """Open an ONNX model: CUDAExecutionProvider when available and preferred, else CPU.

    Raises `ModelFolderError` (a ValueError) naming the file when it is missing or unreadable.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelFolderError(f"missing ONNX model {path}")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if intra_op_threads is not None:
        opts.intra_op_num_threads = int(intra_op_threads)
    providers = ["CPUExecutionProvider"]
    if prefer_cuda and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    try:
        return ort.InferenceSession(str(path), sess_options=opts, providers=providers)
    except Exception as e:  # ORT's Fail/InvalidProtobuf/InvalidGraph/... derive from Exception only
        raise ModelFolderError(f"cannot load ONNX model {path}: {e}") from e


class SpeechTokenizerOnnx:
    """S3Tokenizer v2: Whisper log-mel (100 fps) -> speech token ids (25 Hz, 0..6560)."""

    def __init__(self, path: Path, *, prefer_cuda: bool = True, intra_op_threads: int | None = None):
        self.path = Path(path)
        self.session = make_session(self.path, prefer_cuda=prefer_cuda, intra_op_threads=intra_op_threads)
        inputs = self.session.get_inputs()
        if len(inputs) < 2:
            raise ModelFolderError(f"{self.path}: expected inputs (feats, feats_length), got {len(inputs)}")
        self._feats, self._lengths = inputs[0].name, inputs[1].name

    def __call__(self, logmel: torch.Tensor) -> torch.Tensor:
        """`logmel [1, 128, T]` float -> tokens `[1, T']` int32 (T' ≈ T/4) on the input's device."""
        if logmel.dim() != 3 or logmel.shape[0] != 1:
            raise ValueError(f"speech tokenizer expects log-mel [1, n_mels, T], got {tuple(logmel.shape)}")
        feats = logmel.detach().float().cpu().numpy()
        lengths = np.array([feats.shape[2]], dtype=np.int32)
        out = self.session.run(None, {self._feats: feats, self._lengths: lengths})[0]
        # the real model returns [1, T'] or [1, 1, T'] int64 depending on export: flatten, cast
        tokens = torch.from_numpy(np.asarray(out).reshape(-1).astype(np.int32))
        return tokens[None].to(logmel.device)


class SpeakerEncoderOnnx:
    """CAM++ speaker verification net: CMN'd Kaldi fbank -> x-vector `[1, 192]`.

    The official frontend runs it on CPU with one intra-op thread; those are the defaults here.
    """

    def __init__(self, path: Path, *, prefer_cuda: bool = False, intra_op_threads: int | None = 1):
        self.path = Path(path)
        self.session = make_session(self.path, prefer_cuda=prefer_cuda, intra_op_threads=intra_op_threads)
        self._input = self.session.get_inputs()[0].name

    def __call__(self, fbank_cmn: torch.Tensor) -> torch.Tensor:
        """`fbank_cmn [T, 80]` float -> embedding `[1, 192]` float32 on the input's device."""
        if fbank_cmn.dim() != 2:
            raise ValueError(f"speaker encoder expects fbank [T, n_mels], got {tuple(fbank_cmn.shape)}")
        feats = fbank_cmn.detach().float().cpu().numpy()[None]  # [1, T, 80]
        out = self.session.run(None, {self._input: feats})[0]
        emb = torch.from_numpy(np.asarray(out, dtype=np.float32).reshape(1, -1))
        return emb.to(fbank_cmn.device)
