"""Instruct-mode presets: dialects, emotions and speeds, as the instructions CosyVoice2 was trained on.
Design notes: docs/design.md."""

from __future__ import annotations

PRESETS: tuple[tuple[str, str], ...] = (  # (label, instruction)
    ("Cantonese · 粤语", "用粤语说这句话"),
    ("Sichuanese · 四川话", "用四川话说这句话"),
    ("Shanghainese · 上海话", "用上海话说这句话"),
    ("Northeastern · 东北话", "用东北话说这句话"),
    ("Happy · 开心", "用开心的语气说这句话"),
    ("Sad · 悲伤", "用悲伤的语气说这句话"),
    ("Surprised · 惊讶", "用惊讶的语气说这句话"),
    ("Angry · 生气", "用生气的语气说这句话"),
    ("Whisper · 耳语", "用耳语的方式说这句话"),
    ("Faster · 快一点", "用快一点的语速说这句话"),
    ("Slower · 慢一点", "用慢一点的语速说这句话"),
    ("Calm, slow (English)", "Speak slowly and calmly."),
)


def preset_choices() -> list[tuple[str, str]]:
    """The dropdown's (label, instruction) pairs, a blank first one for "no preset"."""
    return [("—", ""), *PRESETS]


def apply_preset(instruction: str | None, current: str | None = "") -> str:
    """The instruction box after picking `instruction` (the blank choice keeps what was typed)."""
    return instruction if instruction else (current or "")

