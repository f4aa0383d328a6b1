"""A random-weights multilingual Whisper built here, in the Hugging Face layout (no download): tiny for the tests,
full for measuring what the real model costs (bench/aligner.py).

    make_tiny_whisper(folder)               # random: its words depend on the audio
    make_tiny_whisper(folder, rigged=True)  # always says RIGGED_WORD (repeated), detects RIGGED_LANGUAGE
    model, processor = build_whisper(full=True)  # in memory, large-v3-turbo's shapes (809 M parameters)

The tokenizer is a byte-level BPE over the 256 byte symbols plus a few merges, with every Whisper
special token (<|startoftranscript|>, the language tokens, <|transcribe|>, <|notimestamps|>, ...);
generation_config.json carries what `generate` and `detect_language` read (lang_to_id, task_to_id). The full size
keeps this tokenizer: its text takes more tokens than the real one's (a Han character is 3 byte tokens), which
costs the aligner's 4-layer decoder a little more, never less; the 32-layer encoder over 30 s is the same work.
"""

from __future__ import annotations

from pathlib import Path

import torch

RIGGED_WORD = "hello"
RIGGED_LANGUAGE = "fr"
N_MELS = 80  # whisper-tiny..medium; large-v3(-turbo) has 128 (the feature extractor's config says which)
MAX_TARGET_POSITIONS = 64  # decoder positions: prompt + new tokens (448 in OpenAI's checkpoints)
# openai/whisper-large-v3-turbo's shapes (its config.json)
FULL = dict(num_mel_bins=128, d_model=1280, encoder_layers=32, decoder_layers=4, encoder_attention_heads=20,
            decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120, max_target_positions=448)


def make_tiny_whisper(folder: Path, *, rigged: bool = False, seed: int = 0) -> Path:
    """The tiny Whisper saved to `folder` (config, weights, processor), as WhisperAsr.load reads it."""
    model, processor = build_whisper(rigged=rigged, seed=seed)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def build_whisper(*, full: bool = False, rigged: bool = False, seed: int = 0):
    """(WhisperForConditionalGeneration in eval mode, float32 on the CPU; its WhisperProcessor): tiny, or with
    FULL's shapes."""
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizer,
    )
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}  # the 256 byte symbols
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    specials = ["<|endoftext|>", "<|startoftranscript|>", *(f"<|{code}|>" for code in LANGUAGES), "<|translate|>",
                "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]
    for s in specials:
        vocab[s] = len(vocab)
    tokenizer = WhisperTokenizer(vocab=vocab, merges=merges, additional_special_tokens=specials[1:])
    eot, sot = vocab["<|endoftext|>"], vocab["<|startoftranscript|>"]
    shapes = FULL if full else dict(num_mel_bins=N_MELS, d_model=32, encoder_layers=1, decoder_layers=1,
                                    encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                    decoder_ffn_dim=64, max_target_positions=MAX_TARGET_POSITIONS)
    cfg = WhisperConfig(vocab_size=len(vocab), max_source_positions=1500, pad_token_id=eot, bos_token_id=eot,
                        eos_token_id=eot, decoder_start_token_id=sot, **shapes)
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(cfg).eval()
    model.generation_config = GenerationConfig(
        decoder_start_token_id=sot, eos_token_id=eot, pad_token_id=eot, bos_token_id=eot,
        max_length=cfg.max_target_positions, no_timestamps_token_id=vocab["<|notimestamps|>"], is_multilingual=True,
        lang_to_id={f"<|{code}|>": vocab[f"<|{code}|>"] for code in LANGUAGES},
        task_to_id={"transcribe": vocab["<|transcribe|>"], "translate": vocab["<|translate|>"]},
        begin_suppress_tokens=[], suppress_tokens=[])
    if rigged:  # the decoder's last norm outputs a constant v: logits_j = e_j . v (lm head tied to embeddings)
        with torch.no_grad():
            emb = model.model.decoder.embed_tokens.weight  # [V, d_model]
            word, lang = vocab[RIGGED_WORD], vocab[f"<|{RIGGED_LANGUAGE}|>"]
            emb[word] *= 4  # the likeliest token of all ...
            emb[lang] *= 3  # ... and the likeliest language token
            norm = model.model.decoder.layer_norm
            norm.weight.zero_()
            norm.bias.copy_(emb[word] + emb[lang])
    return model, WhisperProcessor(WhisperFeatureExtractor(feature_size=cfg.num_mel_bins), tokenizer)
