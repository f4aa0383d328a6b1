"""The `CosyVoice-BlankEN/` folder of a random model: Qwen2 tokenizer, config, weight skeleton.

Design notes: docs/model.md.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

from app.model.random.sizes import ModelSize

QWEN2_BPE_SIZE = 151_643  # vocab.json rows of Qwen2 (ids 0..151642)
QWEN2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 151643, 151644, 151645
# Qwen2's pre-tokenizer split (same as transformers' Qwen2Tokenizer)
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
TRAINED_BPE_SIZE = 4000  # upper bound; the small corpus stops the trainer earlier
MAX_TOKEN_CHARS = 6  # byte-level chars: up to 6 ASCII letters or 2 CJK characters per token
_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Training text for the built-in tokenizer (written for this project). Any text still encodes:
# byte-level BPE falls back to single bytes.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. Please call Stella and ask her to bring these things
with her from the store: six spoons of fresh snow peas, five thick slabs of blue cheese, and maybe a
snack for her brother Bob. We also need a small plastic snake and a big toy frog for the kids.
Hello, how are you today? I'm fine, thank you. It's a beautiful morning, isn't it? The weather is
warm and the sky is clear. Let's go for a walk in the park and listen to the birds singing.
Speech synthesis turns written text into spoken audio. A voice cloning system listens to a short
prompt recording and then reads new sentences in the same voice, with the same rhythm and tone.
On Monday, 12 March 2024, at 9:30 a.m., the train left platform 3 and arrived 45 minutes later.
She said: "There's no place like home." They'll be here soon; we've waited for 2 hours already.
Numbers like 1, 2, 3, 10, 100, 2025 and 3.14 appear in text, as do symbols such as %, $, & and #.
今天天气很好，我们一起去公园散步吧。请把这些东西从商店带回来：新鲜的豌豆、蓝奶酪和一个玩具青蛙。
语音合成技术可以把文字转换成自然流畅的语音。零样本声音克隆只需要一段很短的提示音频，
就能用同样的音色朗读新的句子。你好，很高兴认识你！请问你叫什么名字？我来自北京，现在住在上海。
我们的模型支持中文和英文，也可以在一句话里混合使用两种语言，例如：这个 demo 非常 cool。
二〇二四年三月十二日上午九点半，火车从三号站台出发，四十五分钟后到达。春天来了，花儿都开了。
他说：“没有什么地方比家更好。”我们已经等了两个小时，他们很快就会到。学习一门新的语言需要耐心和时间。
the of and to in is it you that he was for on are with as his they be at one have this from or
had by word but not what all were we when your can said there use an each which she do how
their if will up other about out many then them these so some her would make like him into
的 一 是 不 了 人 我 在 有 他 这 中 大 来 上 个 们 到 说 国 和 地 也 子 时 道 出 而 要 于 就 下 得
可 你 年 生 自 会 那 后 能 对 着 事 其 里 所 去 行 过 家 十 用 发 天 如 然 作 方 成 者 多 日 都
三 小 二 无 同 么 经 法 当 起 与 好 看 学 进 种 将 还 分 此 心 前 面 又 定 见 只 主 没 公 从 知
"""


def _train_bpe() -> tuple[dict[str, int], list[str]]:
    """Byte-level BPE on `_CORPUS` with Qwen2's pre-tokenizer -> (vocab token->id, merges "a b")."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TRAINED_BPE_SIZE, min_frequency=1, show_progress=False, special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), max_token_length=MAX_TOKEN_CHARS,
    )
    lines = _CORPUS.splitlines(keepends=True)
    tok.train_from_iterator(lines, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return dict(model["vocab"]), merges


def _padded_vocab(vocab: dict[str, int]) -> dict[str, int]:
    """Fill ids len(vocab)..151642 with filler tokens no merge can produce (never emitted)."""
    assert sorted(vocab.values()) == list(range(len(vocab))), "trained ids must be 0..N-1"
    out = dict(sorted(vocab.items(), key=lambda kv: kv[1]))
    for i in range(len(vocab), QWEN2_BPE_SIZE):
        filler = f"<|filler_{i}|>"
        assert filler not in out
        out[filler] = i
    return out


def _check_source_vocab(vocab_path: Path) -> None:
    vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    if len(vocab) != QWEN2_BPE_SIZE or max(vocab.values()) != QWEN2_BPE_SIZE - 1:
        raise ValueError(
            f"{vocab_path}: expected a Qwen2 vocabulary of {QWEN2_BPE_SIZE} entries (ids 0..{QWEN2_BPE_SIZE - 1}), "
            f"got {len(vocab)} entries up to id {max(vocab.values())}; pass a CosyVoice-BlankEN or "
            "Qwen2 tokenizer folder, or no source to build one"
        )


def _write_json(path: Path, data: dict, *, sort_keys: bool = False) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=sort_keys, ensure_ascii=False) + "\n",
                    encoding="utf-8")


def tokenizer_config() -> dict:
    """tokenizer_config.json in Qwen2-0.5B style: 3 added specials, eos/pad `<|endoftext|>`."""
    added = {
        str(QWEN2_BPE_SIZE + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
        for i, t in enumerate(QWEN2_SPECIALS)
    }
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(QWEN2_SPECIALS[1:]),
        "bos_token": None,
        "chat_template": _CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": QWEN2_SPECIALS[0],
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": QWEN2_SPECIALS[0],
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_qwen2_tokenizer(out_dir: str | Path, source: str | Path | None = None) -> Path:
    """Write vocab.json, merges.txt, tokenizer_config.json and generation_config.json into `out_dir`.

    `source`: a folder holding a real Qwen2 / CosyVoice-BlankEN `vocab.json` + `merges.txt`, which
    are copied unchanged; None builds a small byte-level BPE padded to Qwen2's ids (module doc).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if source is not None:
        source = Path(source)
        missing = [n for n in ("vocab.json", "merges.txt") if not (source / n).is_file()]
        if missing:
            raise FileNotFoundError(f"tokenizer source {source} lacks {', '.join(missing)}")
        _check_source_vocab(source / "vocab.json")
        for name in ("vocab.json", "merges.txt"):
            shutil.copyfile(source / name, out_dir / name)
    else:
        vocab, merges = _train_bpe()
        (out_dir / "vocab.json").write_text(
            json.dumps(_padded_vocab(vocab), ensure_ascii=False, separators=(",", ":")), encoding="utf-8")
        (out_dir / "merges.txt").write_text("#version: 0.2\n" + "".join(m + "\n" for m in merges),
                                            encoding="utf-8")
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config())
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": QWEN2_BPE_SIZE, "do_sample": False, "eos_token_id": QWEN2_BPE_SIZE,
        "max_new_tokens": 2048, "transformers_version": "4.40.1",
    })
    return out_dir


def qwen_config(size: ModelSize) -> dict:
    """config.json of the Qwen2 backbone (keys of CosyVoice-BlankEN's file, sizes from `size`)."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": QWEN2_BPE_SIZE,
        "eos_token_id": QWEN2_BPE_SIZE + 2,
        "hidden_act": "silu",
        "hidden_size": size.qwen_hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": size.qwen_intermediate_size,
        "max_position_embeddings": size.qwen_max_position_embeddings,
        "max_window_layers": size.qwen_num_layers,
        "model_type": "qwen2",
        "num_attention_heads": size.qwen_num_heads,
        "num_hidden_layers": size.qwen_num_layers,
        "num_key_value_heads": size.qwen_num_kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": size.qwen_max_position_embeddings,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": size.qwen_vocab_size,
    }


def write_qwen_config(out_dir: str | Path, size: ModelSize) -> Path:
    """Write `out_dir/config.json` (Qwen2ForCausalLM, tied embeddings, rope_theta 1e6)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "config.json"
    _write_json(path, qwen_config(size), sort_keys=True)
    return path


def qwen2_tensor_shapes(size: ModelSize) -> dict[str, tuple[int, ...]]:
    """Qwen2ForCausalLM's state-dict names -> shapes, without `lm_head.weight` (tied to embed_tokens)."""
    h, i = size.qwen_hidden_size, size.qwen_intermediate_size
    kv = size.qwen_num_kv_heads * size.qwen_head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (size.qwen_vocab_size, h)}
    for n in range(size.qwen_num_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    shapes["model.norm.weight"] = (h,)
    return shapes


def write_safetensors_skeleton(out_dir: str | Path, size: ModelSize) -> Path:
    """Write a zero-filled bf16 `model.safetensors` for Qwen2ForCausalLM (~1 GB for FULL).

    Only the header is built in memory: safetensors = u64 little-endian header length, JSON header
    (names sorted, as the safetensors library writes them; padded with spaces to 8 bytes), then the
    raw tensor bytes. The data section is all zeros, so the file is extended with `truncate`
    (sparse where the file system allows) instead of writing the bytes.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in sorted(qwen2_tensor_shapes(size).items()):
        n_bytes = 2  # bf16
        for d in shape:
            n_bytes *= d
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n_bytes]}
        offset += n_bytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    path = out_dir / "model.safetensors"
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.truncate(8 + len(text) + offset)
    return path
