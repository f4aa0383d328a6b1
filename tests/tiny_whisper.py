"""A random-weights multilingual Whisper built here, in the Hugging Face layout (no download).

    make_tiny_whisper(folder)               # random: its words depend on the audio
    make_tiny_whisper(folder, rigged=True)  # always says RIGGED_WORD (repeated), detects RIGGED_LANGUAGE

The tokenizer is a byte-level BPE over the 256 byte symbols plus a few merges, with every Whisper
special token (<|startoftranscript|>, the language tokens, <|transcribe|>, <|notimestamps|>, ...);
generation_config.json carries what `generate` and `detect_language` read (lang_to_id, task_to_id).
"""

from __future__ import annotations

from pathlib import Path

import torch

RIGGED_WORD = "hello"
RIGGED_LANGUAGE = "fr"
N_MELS = 80  # whisper-tiny..medium; large-v3(-turbo) has 128 (the feature extractor's config says which)
MAX_TARGET_POSITIONS = 64  # decoder positions: prompt + new tokens (448 in OpenAI's checkpoints)


def make_tiny_whisper(folder: Path, *, rigged: bool = False, seed: int = 0) -> Path:
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
    cfg = WhisperConfig(vocab_size=len(vocab), num_mel_bins=N_MELS, d_model=32, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                        max_source_positions=1500, max_target_positions=MAX_TARGET_POSITIONS, pad_token_id=eot,
                        bos_token_id=eot, eos_token_id=eot, decoder_start_token_id=sot)
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(cfg).eval()
    model.generation_config = GenerationConfig(
        decoder_start_token_id=sot, eos_token_id=eot, pad_token_id=eot, bos_token_id=eot,
        max_length=MAX_TARGET_POSITIONS, no_timestamps_token_id=vocab["<|notimestamps|>"], is_multilingual=True,
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
    model.save_pretrained(folder)
    WhisperProcessor(WhisperFeatureExtractor(feature_size=N_MELS), tokenizer).save_pretrained(folder)
    return folder
