"""Where the model folder comes from: an explicit folder, the Hugging Face Hub (cache first), or a
generated tiny random model when neither is available (offline demos; the output is noise).
Design notes: docs/model.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.config import ModelConfig
from app.message import Message
from app.model.hparams import ModelFolderError
from app.model.loader import REQUIRED_FILES, check_model_dir

log = logging.getLogger(__name__)

# only what the loader reads (no BlankEN safetensors, JIT/TensorRT/ONNX-estimator extras): ~3 GB
DOWNLOAD_PATTERNS = [f for f in REQUIRED_FILES if "/" not in f] + ["CosyVoice-BlankEN/*.json",
                                                                    "CosyVoice-BlankEN/*.txt"]


def progress_class(report: Callable[[int, int], None]) -> type:
    """A huggingface_hub tqdm that also reports the snapshot's byte progress to `report(done, total)`."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    class Progress(hf_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._bytes_bar = kwargs.get("name") == "huggingface_hub.snapshot_download"  # the reconstruct bar
            self._done = int(kwargs.get("initial") or 0)
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            self._done += int(n or 0)
            if self._bytes_bar and self.total:
                report(self._done, int(self.total))
            return super().update(n)

    return Progress


def download_model(repo_id: str, report: Callable[[int, int], None]) -> Path:
    """The files the loader needs from `repo_id` (a cached snapshot first, then the Hub)."""
    from huggingface_hub import snapshot_download

    with contextlib.suppress(OSError, ValueError):  # not (fully) cached: download below
        path = Path(snapshot_download(repo_id, allow_patterns=DOWNLOAD_PATTERNS, local_files_only=True))
        check_model_dir(path)
        return path
    return Path(snapshot_download(repo_id, allow_patterns=DOWNLOAD_PATTERNS, tqdm_class=progress_class(report)))


RANDOM_MARKER = "RANDOM_WEIGHTS.json"  # written by app/model/random/make.py into every folder it generates


def is_random(folder: Path) -> bool:
    """A folder of generated random weights (its marker file; no official or converted folder has one)."""
    return (folder / RANDOM_MARKER).is_file()


def random_model(folder: Path) -> Path:
    """A tiny random model in `folder`, generated once (atomically: built beside it, then renamed)."""
    with contextlib.suppress(ModelFolderError):
        check_model_dir(folder)
        return folder
    from app.model.random.make import make_model
    from app.model.random.sizes import TINY

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        make_model(tmp / "m", TINY, seed=0)
        shutil.rmtree(folder, ignore_errors=True)  # a broken leftover
        (tmp / "m").rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def model_fingerprint(model_dir: Path) -> str:
    """Identity of the voice-feature extractors (speech tokenizer, CAM++, text tokenizer) of a folder.

    Size plus the first MiB of each file: cheap, and different for every model we know of.
    """
    h = hashlib.sha256()
    for name in ("speech_tokenizer_v2.onnx", "campplus.onnx", "CosyVoice-BlankEN/vocab.json",
                 "CosyVoice-BlankEN/tokenizer.json"):
        f = model_dir / name
        if f.is_file():
            with f.open("rb") as fh:
                h.update(f"{name}:{f.stat().st_size}:".encode() + fh.read(1 << 20))
    return h.hexdigest()[:16]


def resolve_model_dir(m: ModelConfig, set_status: Callable[[str], None]) -> tuple[Path, bool]:
    """(model folder, is it a generated random model) for `[model]` (blocking: may download or generate)."""
    if m.dir:  # given explicitly: use it or fail, never fall back silently
        path = Path(m.dir).expanduser().resolve()
        check_model_dir(path)
        return path, is_random(path)
    if m.download:
        set_status(Message("state_looking", "looking for {repo} (cache, then the Hugging Face Hub)", repo=m.repo_id))
        try:
            path = download_model(m.repo_id, lambda done, total: set_status(Message(
                "state_downloading", "downloading {repo}: {done:.2f} / {total:.2f} GB", repo=m.repo_id,
                done=done / 1e9, total=total / 1e9)))
            return path, is_random(path)
        except Exception as e:  # offline, DNS, HTTP errors, HF_HUB_OFFLINE=1: all mean "use the fallback"
            log.warning("cannot download %s (%s): falling back to a generated tiny random model",
                        m.repo_id, str(e).splitlines()[0] if str(e) else type(e).__name__)
    set_status(Message("state_random", "generating a tiny random model (no weights available; output will be noise)"))
    return random_model(Path(m.random_model_dir).expanduser().resolve()), True
