"""The size-independent parts of `make_model`: sizes, yaml, ONNX stand-ins, BlankEN folder."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import struct
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from app.model.hparams import load_hparams, read_hyperpyyaml
from app.model.random.sizes import FULL, SIZES, TINY, TOKENIZER_LEN, ModelSize
from app.model.random.standins import write_campplus, write_speech_tokenizer
from app.model.random.tokenizer_files import (
    qwen2_tensor_shapes,
    write_qwen2_tokenizer,
    write_qwen_config,
    write_safetensors_skeleton,
)
from app.model.random.yaml_template import render_cosyvoice2_yaml

# head sizes vLLM's CPU attention accepts (vllm_feasibility.md §2, item 3): both sizes must run there
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# CosyVoice2Tokenizer's added specials, in order (cosyvoice_internals.md §2.3)
COSYVOICE_SPECIALS = [
    "<|im_start|>", "<|im_end|>", "<|endofprompt|>", "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]", "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]",
]


def fixture_size(model_dir: Path) -> ModelSize:
    """The sizes a fixture set declares (its cosyvoice2.yaml numbers and BlankEN config.json), as a
    ModelSize, so make_model's output is compared with what that set says, not with the public set."""
    hp = load_hparams(model_dir)
    q, enc, est = hp.llm.qwen, hp.flow.encoder, hp.flow.estimator
    return ModelSize(
        name="fixture", qwen_hidden_size=q.hidden_size, qwen_num_layers=q.num_layers, qwen_num_heads=q.num_heads,
        qwen_num_kv_heads=q.num_kv_heads, qwen_intermediate_size=q.intermediate_size, qwen_vocab_size=q.vocab_size,
        qwen_max_position_embeddings=q.max_position_embeddings, llm_input_size=hp.llm.llm_input_size,
        llm_output_size=hp.llm.llm_output_size, flow_input_size=hp.flow.input_size,
        encoder_output_size=enc.output_size, encoder_attention_heads=enc.attention_heads,
        encoder_linear_units=enc.linear_units, encoder_num_blocks=enc.num_blocks,
        estimator_channels=tuple(est.channels), estimator_attention_head_dim=est.attention_head_dim,
        estimator_n_blocks=est.n_blocks, estimator_num_mid_blocks=est.num_mid_blocks,
        estimator_num_heads=est.num_heads, hift_base_channels=hp.hift.base_channels,
        hift_f0_cond_channels=hp.hift.f0_cond_channels)


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _tokens(sess: ort.InferenceSession, feats: np.ndarray, length: int | None = None) -> np.ndarray:
    n = feats.shape[2] if length is None else length
    return sess.run(None, {"feats": feats, "feats_length": np.array([n], dtype=np.int32)})[0]


# --- sizes -------------------------------------------------------------------------------------


def test_sizes():
    assert SIZES == {"tiny": TINY, "full": FULL}
    assert (FULL.qwen_hidden_size, FULL.qwen_num_layers, FULL.qwen_num_heads, FULL.qwen_num_kv_heads,
            FULL.qwen_intermediate_size, FULL.qwen_vocab_size) == (896, 24, 14, 2, 4864, 151936)
    assert TINY.qwen_head_dim == FULL.qwen_head_dim == 64 and {TINY.qwen_head_dim, FULL.qwen_head_dim} <= set(
        VLLM_CPU_HEAD_DIMS)
    with pytest.raises(ValueError, match="llm_input_size"):
        dataclasses.replace(TINY, llm_input_size=96)
    with pytest.raises(ValueError, match="qwen_vocab_size"):
        dataclasses.replace(TINY, qwen_vocab_size=TOKENIZER_LEN - 1)
    assert dataclasses.replace(TINY, qwen_num_heads=8, qwen_num_kv_heads=1).qwen_head_dim not in VLLM_CPU_HEAD_DIMS


# --- cosyvoice2.yaml + config.json -------------------------------------------------------------


def _folder(tmp_path: Path, size: ModelSize) -> Path:
    (tmp_path / "cosyvoice2.yaml").write_text(render_cosyvoice2_yaml(size), encoding="utf-8")
    write_qwen_config(tmp_path / "CosyVoice-BlankEN", size)
    return tmp_path


@pytest.mark.parametrize("size", [TINY, FULL], ids=lambda s: s.name)
def test_yaml_and_config_read_back(tmp_path, size):
    hp = load_hparams(_folder(tmp_path, size))  # = hparams_from_dict(read_hyperpyyaml(yaml), qwen)
    q = hp.llm.qwen
    assert (q.hidden_size, q.num_layers, q.num_heads, q.num_kv_heads, q.intermediate_size, q.vocab_size,
            q.max_position_embeddings, q.rope_theta, q.rms_norm_eps) == (
        size.qwen_hidden_size, size.qwen_num_layers, size.qwen_num_heads, size.qwen_num_kv_heads,
        size.qwen_intermediate_size, size.qwen_vocab_size, 32768, 1e6, 1e-6)
    assert (hp.llm.llm_input_size, hp.llm.llm_output_size, hp.llm.speech_token_size) == (
        size.llm_input_size, size.llm_output_size, 6561)
    enc, est = hp.flow.encoder, hp.flow.estimator
    assert (hp.flow.input_size, enc.input_size, enc.output_size, enc.attention_heads, enc.linear_units,
            enc.num_blocks) == (size.flow_input_size, size.flow_input_size, size.encoder_output_size,
                                size.encoder_attention_heads, size.encoder_linear_units, size.encoder_num_blocks)
    assert (est.channels, est.attention_head_dim, est.n_blocks, est.num_mid_blocks, est.num_heads,
            est.static_chunk_size, est.in_channels) == (
        size.estimator_channels, size.estimator_attention_head_dim, size.estimator_n_blocks,
        size.estimator_num_mid_blocks, size.estimator_num_heads, 50, 320)
    assert (hp.hift.base_channels, hp.hift.f0_cond_channels, hp.hift.upsample_factor) == (
        size.hift_base_channels, size.hift_f0_cond_channels, 480)
    assert (hp.feat.fmax, hp.sample_rate, hp.chunk_size, hp.token_mel_ratio) == (8000.0, 24000, 25, 2)


def test_full_yaml_has_the_real_numbers(tmp_path):
    hp = load_hparams(_folder(tmp_path, FULL))
    assert (hp.llm.llm_input_size, hp.flow.input_size, hp.flow.encoder.output_size,
            hp.flow.encoder.attention_heads, hp.flow.encoder.linear_units, hp.flow.encoder.num_blocks) == (
        896, 512, 512, 8, 2048, 6)
    est = hp.flow.estimator
    assert (est.channels, est.attention_head_dim, est.n_blocks, est.num_mid_blocks, est.num_heads) == (
        (256,), 64, 4, 12, 8)
    assert (hp.hift.base_channels, hp.hift.f0_cond_channels) == (512, 512)
    assert "RANDOM" in (tmp_path / "cosyvoice2.yaml").read_text().splitlines()[0]


@pytest.mark.parity
def test_yaml_and_config_match_the_fixture(tmp_path, parity_model_dir):
    """make_model at the sizes the set declares writes the set's yaml data and BlankEN config.json."""
    _folder(tmp_path, fixture_size(parity_model_dir))
    # same keys, class tags dropped, refs resolved: identical data to the official-derived yaml
    assert read_hyperpyyaml(tmp_path / "cosyvoice2.yaml") == read_hyperpyyaml(parity_model_dir / "cosyvoice2.yaml")
    for name in ("config.json",):
        assert (tmp_path / "CosyVoice-BlankEN" / name).read_bytes() == (
            parity_model_dir / "CosyVoice-BlankEN" / name).read_bytes()


# --- ONNX stand-ins ----------------------------------------------------------------------------


def test_campplus_standin(tmp_path):
    sess = _session(write_campplus(tmp_path / "campplus.onnx", seed=3))
    (inp,), (out,) = sess.get_inputs(), sess.get_outputs()
    assert (inp.name, inp.type, inp.shape) == ("input", "tensor(float)", [1, "T", 80])
    assert (out.name, out.type, out.shape) == ("output", "tensor(float)", [1, 192])
    x = np.random.default_rng(0).normal(0, 3, (1, 120, 80)).astype(np.float32)
    e = sess.run(None, {"input": x})[0]
    assert e.shape == (1, 192) and e.dtype == np.float32 and np.isfinite(e).all()
    e_other = sess.run(None, {"input": x[:, :60] * 0.5})[0]
    assert np.abs(e - e_other).max() > 1e-3
    np.testing.assert_array_equal(sess.run(None, {"input": x})[0], e)
    write_campplus(tmp_path / "again.onnx", seed=3)
    write_campplus(tmp_path / "other.onnx", seed=4)
    assert (tmp_path / "again.onnx").read_bytes() == (tmp_path / "campplus.onnx").read_bytes()
    assert np.abs(_session(tmp_path / "other.onnx").run(None, {"input": x})[0] - e).max() > 1e-3


def test_speech_tokenizer_standin(tmp_path):
    sess = _session(write_speech_tokenizer(tmp_path / "tok.onnx", seed=5))
    assert [(i.name, i.type, i.shape) for i in sess.get_inputs()] == [
        ("feats", "tensor(float)", [1, 128, "T"]), ("feats_length", "tensor(int32)", [1])]
    assert [(o.name, o.type) for o in sess.get_outputs()] == [("indices", "tensor(int64)")]
    rng = np.random.default_rng(1)
    for n_frames, n_tokens in [(1, 1), (2, 1), (3, 1), (4, 1), (5, 2), (7, 2), (8, 2), (9, 3), (100, 25),
                               (442, 111), (3000, 750)]:
        assert math.ceil(math.ceil(n_frames / 2) / 2) == n_tokens  # T' = ceil(ceil(T/2)/2), as the real 25 Hz one
        out = _tokens(sess, rng.normal(0, 1, (1, 128, n_frames)).astype(np.float32))
        assert out.shape == (1, n_tokens) and out.dtype == np.int64
        assert out.min() >= 0 and out.max() <= 6560
    feats = rng.normal(0, 1, (1, 128, 400)).astype(np.float32)
    tokens = _tokens(sess, feats)
    assert len(np.unique(tokens)) > 30  # 100 tokens of noise: not constant
    np.testing.assert_array_equal(_tokens(sess, feats), tokens)
    # frames at or after feats_length are ignored (zeroed), whatever they hold
    zero_tail = feats.copy()
    zero_tail[:, :, 300:] = 0
    np.testing.assert_array_equal(_tokens(sess, feats, 300), _tokens(sess, zero_tail, 300))
    assert not np.array_equal(_tokens(sess, feats, 300), tokens)
    write_speech_tokenizer(tmp_path / "again.onnx", seed=5)
    assert (tmp_path / "again.onnx").read_bytes() == (tmp_path / "tok.onnx").read_bytes()
    other = _tokens(_session(write_speech_tokenizer(tmp_path / "other.onnx", seed=6)), feats)
    assert (other != tokens).mean() > 0.5


@pytest.mark.parity
def test_speech_tokenizer_varied_on_speech(tmp_path, golden):
    """On the fixture prompt's whisper log-mel (espeak speech, 4.4 s) tokens vary like speech tokens."""
    sess = _session(write_speech_tokenizer(tmp_path / "tok.onnx", seed=0))
    fe = golden("frontend")
    a, b = _tokens(sess, fe["a_whisper_logmel"]), _tokens(sess, fe["b_whisper_logmel"])
    assert a.shape == fe["a_speech_token_raw"].shape  # = the official tokenizer's count for this prompt
    assert len(np.unique(a)) > 50 and np.mean(a[0, 1:] != a[0, :-1]) > 0.7
    assert np.mean(a == b) > 0.6  # same speech via another resampling path: mostly the same tokens
    spk = _session(write_campplus(tmp_path / "campplus.onnx", seed=0))
    e = spk.run(None, {"input": fe["a_kaldi_fbank_cmn"][None]})[0]
    assert e.shape == (1, 192) and np.isfinite(e).all()


# --- tokenizer ---------------------------------------------------------------------------------


def _check_qwen2_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert len(tok) == 151646
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    for text in ["Please call Stella and ask her to bring these things.", "今天天气很好，我们一起去公园散步吧。",
                 "Mixed 中英文 text, 123 & émojis 😀!"]:
        ids = tok([text]).input_ids[0]
        assert ids and max(ids) < 151643 and tok.decode(ids) == text
    # what CosyVoice2Tokenizer does on top (cosyvoice_internals.md §2.3)
    tok.add_special_tokens({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                            "additional_special_tokens": COSYVOICE_SPECIALS})
    assert len(tok) == TOKENIZER_LEN
    assert tok.convert_tokens_to_ids("<|endofprompt|>") == 151646
    assert tok.convert_tokens_to_ids(COSYVOICE_SPECIALS[2:]) == list(range(151646, 151663))
    ids = tok(["You are a helpful assistant.<|endofprompt|>[breath]Hi"]).input_ids[0]
    assert 151646 in ids and 151647 in ids
    return tok


def test_built_tokenizer(tmp_path):
    folder = write_qwen2_tokenizer(tmp_path / "a")
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    assert len(vocab) == 151643 and sorted(vocab.values()) == list(range(151643))
    assert (folder / "merges.txt").read_text(encoding="utf-8").startswith("#version: 0.2\n")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "Qwen2Tokenizer" and cfg["eos_token"] == cfg["pad_token"] == "<|endoftext|>"
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 151643
    tok = _check_qwen2_tokenizer(folder)
    n_trained = min(i for t, i in vocab.items() if t.startswith("<|filler_"))
    assert max(tok(["<|filler_151000|> <|filler_9|>"]).input_ids[0]) < n_trained  # fillers unreachable
    again = write_qwen2_tokenizer(tmp_path / "b")
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (folder / name).read_bytes(), name


@pytest.mark.parity
def test_copied_tokenizer(tmp_path, parity_model_dir):
    src = parity_model_dir / "CosyVoice-BlankEN"
    folder = write_qwen2_tokenizer(tmp_path / "BlankEN", source=src)
    for name in ("vocab.json", "merges.txt"):
        assert (folder / name).read_bytes() == (src / name).read_bytes()
    assert json.loads((folder / "tokenizer_config.json").read_text()) == json.loads(
        (src / "tokenizer_config.json").read_text())
    assert (folder / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()
    _check_qwen2_tokenizer(folder)


def test_tokenizer_source_checked(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"merges\.txt"):
        write_qwen2_tokenizer(tmp_path / "out", source=tmp_path)
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(ValueError, match="151643"):
        write_qwen2_tokenizer(tmp_path / "out", source=tmp_path)


# --- model.safetensors skeleton ----------------------------------------------------------------


def _header(path: Path) -> tuple[int, dict]:
    """(header bytes, header) of a safetensors file."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def test_safetensors_skeleton_loads_into_qwen2(tmp_path):
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, Qwen2ForCausalLM

    folder = tmp_path / "BlankEN"
    write_qwen_config(folder, TINY)
    path = write_safetensors_skeleton(folder, TINY)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Qwen2ForCausalLM(config).state_dict().items()}
    assert expected.pop("lm_head.weight") == (151936, 128)  # tied: not stored, as in Qwen2-0.5B
    assert expected == qwen2_tensor_shapes(TINY)
    with safe_open(path, framework="pt") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == expected  # noqa: SIM118
        norm = f.get_tensor("model.norm.weight")
        assert norm.dtype == torch.bfloat16 and not norm.any()
    model, info = Qwen2ForCausalLM.from_pretrained(folder, local_files_only=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_full_safetensors_skeleton_header(tmp_path):
    path = write_safetensors_skeleton(tmp_path, FULL)
    n_header, header = _header(path)
    assert header.pop("__metadata__") == {"format": "pt"}
    n_params = sum(int(np.prod(v["shape"])) for v in header.values())
    assert n_params == 494_032_768  # Qwen2-0.5B
    assert len(header) == 1 + 24 * 12 + 1 and header["model.embed_tokens.weight"]["shape"] == [151936, 896]
    assert all(v["dtype"] == "BF16" for v in header.values())
    spans = sorted(tuple(v["data_offsets"]) for v in header.values())
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert spans[-1][1] == 2 * n_params and n_header % 8 == 0
    assert path.stat().st_size == 8 + n_header + 2 * n_params  # ~988 MB of zeros


@pytest.mark.parity
def test_safetensors_skeleton_matches_fixture(tmp_path, parity_model_dir):
    ours = write_safetensors_skeleton(tmp_path, fixture_size(parity_model_dir)).read_bytes()
    assert ours == (parity_model_dir / "CosyVoice-BlankEN" / "model.safetensors").read_bytes()
