"""Text tokenizer of CosyVoice2: the Qwen2 BPE of `CosyVoice-BlankEN/` plus CosyVoice's specials.

Design notes: docs/model.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from app.model.hparams import ModelFolderError

EOS_TOKEN = "<|endoftext|>"  # also the pad token
# already in the Qwen2 vocabulary; the official list names them first
CHAT_TOKENS: tuple[str, ...] = ("<|im_start|>", "<|im_end|>")
# the 17 specials CosyVoice2 adds, in the official order (ids 151646..151662 on the real vocab)
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endofprompt|>",
    "[breath]",
    "<strong>",
    "</strong>",
    "[noise]",
    "[laughter]",
    "[cough]",
    "[clucking]",
    "[accent]",
    "[quick_breath]",
    "<laughter>",
    "</laughter>",
    "[hissing]",
    "[sigh]",
    "[vocalized-noise]",
    "[lipsmack]",
    "[mn]",
)
# `additional_special_tokens` exactly as the official tokenizer passes them
ADDITIONAL_SPECIAL_TOKENS: tuple[str, ...] = CHAT_TOKENS + SPECIAL_TOKENS
# one of these is enough to load the BPE (tokenizer.json wins when present)
_VOCAB_FILES = ("tokenizer.json", "vocab.json")


class SpeechTextTokenizer:
    """Qwen2 BPE + CosyVoice2 specials; `encode` reproduces the official text ids exactly.

    Encoding runs on the fast tokenizer's Rust backend directly (no per-call state is toggled), so
    one instance can be shared across threads.
    """

    def __init__(self, hf_tokenizer, folder: Path) -> None:
        self.folder = folder
        self._hf = hf_tokenizer
        self._backend = hf_tokenizer.backend_tokenizer
        names = (EOS_TOKEN, *ADDITIONAL_SPECIAL_TOKENS)
        self.special_token_ids: dict[str, int] = {n: hf_tokenizer.convert_tokens_to_ids(n) for n in names}
        self._len = len(hf_tokenizer)

    @classmethod
    def from_dir(cls, blank_en_dir: Path) -> SpeechTextTokenizer:
        """Load `CosyVoice-BlankEN/` (vocab.json + merges.txt + tokenizer_config.json, or
        tokenizer.json) offline and add the CosyVoice2 specials like the official tokenizer."""
        folder = Path(blank_en_dir)
        if not folder.is_dir():
            raise ModelFolderError(f"tokenizer folder {folder} does not exist (expected CosyVoice-BlankEN/)")
        if not any((folder / f).is_file() for f in _VOCAB_FILES):
            raise ModelFolderError(
                f"tokenizer folder {folder} has neither tokenizer.json nor vocab.json + merges.txt"
            )
        if not (folder / "tokenizer.json").is_file() and not (folder / "merges.txt").is_file():
            raise ModelFolderError(f"tokenizer folder {folder} has vocab.json but no merges.txt")
        from transformers import AutoTokenizer  # heavy import, only when a model is loaded

        try:
            hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as e:  # the Rust BPE reports a corrupt vocab/merges as a plain Exception
            raise ModelFolderError(f"cannot load the tokenizer in {folder}: {e}") from e
        if not hasattr(hf, "backend_tokenizer"):
            raise ModelFolderError(f"tokenizer in {folder} is not a fast (Rust) tokenizer: {type(hf)}")
        hf.add_special_tokens(
            {
                "eos_token": EOS_TOKEN,
                "pad_token": EOS_TOKEN,
                "additional_special_tokens": list(ADDITIONAL_SPECIAL_TOKENS),
            }
        )
        return cls(hf, folder)

    def encode(self, text: str) -> list[int]:
        """Text -> ids, no BOS/EOS; special-token strings in `text` become their special ids."""
        return self._backend.encode(text, add_special_tokens=True).ids

    def count_tokens(self, text: str) -> int:
        """Number of ids `encode(text)` gives (the length unit of English segment splitting)."""
        return len(self.encode(text))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Ids -> text; drops specials by default, like the official `decode`."""
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        """Vocabulary size including the added specials (151663 on the real BlankEN vocab)."""
        return self._len
