"""Every number that differs between the random checkpoints `make_model` can write.

Design notes: docs/model.md.
"""

from __future__ import annotations

from dataclasses import dataclass

# Ids up to 151662 come out of the tokenizer (151643 BPE + 3 Qwen2 + 17 CosyVoice specials).
TOKENIZER_LEN = 151_663
QWEN2_VOCAB_SIZE = 151_936  # embed_tokens rows of Qwen2-0.5B (tokenizer length padded for GPUs)


@dataclass(frozen=True)
class ModelSize:
    """Sizes of one random CosyVoice2 checkpoint (Qwen2 LM, flow, HiFT)."""

    name: str
    # Qwen2 backbone (CosyVoice-BlankEN/config.json)
    qwen_hidden_size: int
    qwen_num_layers: int
    qwen_num_heads: int
    qwen_num_kv_heads: int
    qwen_intermediate_size: int
    qwen_vocab_size: int  # text rows of embed_tokens; >= TOKENIZER_LEN
    qwen_max_position_embeddings: int
    # Qwen2LM wrapper (llm_embedding / speech_embedding / llm_decoder widths)
    llm_input_size: int
    llm_output_size: int
    # flow: token embedding width, UpsampleConformerEncoder
    flow_input_size: int
    encoder_output_size: int
    encoder_attention_heads: int
    encoder_linear_units: int
    encoder_num_blocks: int
    # flow estimator CausalConditionalDecoder
    estimator_channels: tuple[int, ...]
    estimator_attention_head_dim: int
    estimator_n_blocks: int
    estimator_num_mid_blocks: int
    estimator_num_heads: int
    # HiFT
    hift_base_channels: int
    hift_f0_cond_channels: int

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"ModelSize {self.name!r}: {what}")

        need(self.qwen_hidden_size % self.qwen_num_heads == 0, "qwen_hidden_size must divide by heads")
        need(self.qwen_num_heads % self.qwen_num_kv_heads == 0, "qwen_num_heads must divide by kv heads")
        need(self.qwen_head_dim % 2 == 0, "Qwen2 head_dim must be even (rotary embedding)")
        need(self.qwen_vocab_size >= TOKENIZER_LEN, f"qwen_vocab_size must be >= {TOKENIZER_LEN}")
        need(self.llm_input_size == self.qwen_hidden_size, "llm_input_size must equal qwen_hidden_size")
        need(self.llm_output_size == self.qwen_hidden_size, "llm_output_size must equal qwen_hidden_size")
        need(self.encoder_output_size % self.encoder_attention_heads == 0,
             "encoder_output_size must divide by encoder_attention_heads")
        need(len(self.estimator_channels) >= 1, "estimator_channels must not be empty")
        need(self.hift_base_channels % 8 == 0, "hift_base_channels must divide by 8 (three 2x halvings)")

    @property
    def qwen_head_dim(self) -> int:
        return self.qwen_hidden_size // self.qwen_num_heads


# CosyVoice2-0.5B (Qwen2-0.5B backbone, head_dim 64).
FULL = ModelSize(
    name="full",
    qwen_hidden_size=896, qwen_num_layers=24, qwen_num_heads=14, qwen_num_kv_heads=2,
    qwen_intermediate_size=4864, qwen_vocab_size=QWEN2_VOCAB_SIZE, qwen_max_position_embeddings=32768,
    llm_input_size=896, llm_output_size=896,
    flow_input_size=512, encoder_output_size=512, encoder_attention_heads=8, encoder_linear_units=2048,
    encoder_num_blocks=6,
    estimator_channels=(256,), estimator_attention_head_dim=64, estimator_n_blocks=4,
    estimator_num_mid_blocks=12, estimator_num_heads=8,
    hift_base_channels=512, hift_f0_cond_channels=512,
)

# CPU test model. Qwen2: head_dim 64 (2 heads of 64, 1 KV head) because vLLM's CPU attention has no
# smaller head size; every linear dim is a multiple of 32 so CPU W4A16 kernels accept it. The text
# vocabulary stays at Qwen2's 151936 rows (same shapes as the real embed_tokens; 78 MB fp32).
# Flow and HiFT use the parity fixture's dims.
TINY = ModelSize(
    name="tiny",
    qwen_hidden_size=128, qwen_num_layers=2, qwen_num_heads=2, qwen_num_kv_heads=1,
    qwen_intermediate_size=256, qwen_vocab_size=QWEN2_VOCAB_SIZE, qwen_max_position_embeddings=32768,
    llm_input_size=128, llm_output_size=128,
    flow_input_size=64, encoder_output_size=64, encoder_attention_heads=2, encoder_linear_units=128,
    encoder_num_blocks=2,
    estimator_channels=(64,), estimator_attention_head_dim=32, estimator_n_blocks=1,
    estimator_num_mid_blocks=2, estimator_num_heads=2,
    hift_base_channels=32, hift_f0_cond_channels=32,
)

SIZES: dict[str, ModelSize] = {"tiny": TINY, "full": FULL}
