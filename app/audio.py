"""Audio units and DSP helpers shared by every layer.

Units are named constants (whisper/audio.py style) so shapes can be derived, never guessed:
speech tokens run at 25 Hz, each token is 2 mel frames (50 Hz), each mel frame is 480 samples
at the 24 kHz output rate.
"""

from __future__ import annotations

OUTPUT_SAMPLE_RATE_HZ = 24_000  # HiFT output and prompt-mel rate
PROMPT_SAMPLE_RATE_HZ = 16_000  # speech tokenizer and CAM++ rate
TOKEN_RATE_HZ = 25  # speech tokens per second
MEL_FRAMES_PER_TOKEN = 2  # token_mel_ratio
MEL_RATE_HZ = TOKEN_RATE_HZ * MEL_FRAMES_PER_TOKEN  # 50 mel frames per second
SAMPLES_PER_MEL_FRAME = OUTPUT_SAMPLE_RATE_HZ // MEL_RATE_HZ  # 480
SAMPLES_PER_TOKEN = SAMPLES_PER_MEL_FRAME * MEL_FRAMES_PER_TOKEN  # 960
N_MELS = 80  # prompt mel / flow output channels
MAX_PROMPT_SECONDS = 30.0  # the speech tokenizer refuses longer prompts
