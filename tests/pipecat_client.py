"""A pipecat pipeline that speaks through `ElevenLabsTTSService` as pipecat documents it (its `pipecat init`
template), unchanged but for `url` and `api_key`: one `TTSSpeakFrame`, then an LLM reply as token frames.
Run by tests/test_agent_doors.py with `.venv-agents/bin/python` (requirements-agents.txt); the studio's venv
never imports it. Prints one JSON line: the audio received (bytes, frames, sample rate, per context), the
frames seen downstream and any error frames.

Use: .venv-agents/bin/python tests/pipecat_client.py ws://HOST:PORT VOICE_ID [SAMPLE_RATE_HZ]
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter

import numpy as np
from pipecat.frames.frames import (
    ErrorFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
)
from pipecat.services.elevenlabs.tts import ElevenLabsTTSService
from pipecat.tests.utils import run_test

SPOKEN = "Hello there, how are you today?"
LLM_TOKENS = ("The ", "weather ", "is ", "lovely", " today", ". ", "Shall ", "we ", "walk", "?")


async def speak(url: str, voice: str, sample_rate_hz: int) -> dict:
    """The pipeline's run as a JSON-ready summary."""
    tts = ElevenLabsTTSService(
        api_key="unused",  # the studio runs without keys here; the real service would need one
        url=url,
        sample_rate=sample_rate_hz,
        settings=ElevenLabsTTSService.Settings(voice=voice),
    )
    frames = [TTSSpeakFrame(SPOKEN), LLMFullResponseStartFrame(), *map(LLMTextFrame, LLM_TOKENS),
              LLMFullResponseEndFrame()]
    # run_test sends an EndFrame after these; the service's stop waits until every context has played.
    # start_timeout: the service connects during setup, slow on a loaded 2-core CI box (default 1 s)
    down, up = await run_test(tts, frames_to_send=frames, start_timeout=30)
    audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
    per_context: dict[str, int] = {}
    for f in audio:
        per_context[str(f.context_id)] = per_context.get(str(f.context_id), 0) + len(f.audio)
    pcm = np.frombuffer(b"".join(f.audio for f in audio), dtype="<i2")  # s16le mono, as ElevenLabs' pcm_<rate>
    return {
        "texts": [SPOKEN, "".join(LLM_TOKENS)],  # one context each, in this order
        "bytes": sum(len(f.audio) for f in audio),
        "peak": int(np.abs(pcm.astype(np.int32)).max(initial=0)),  # 0: silence
        "frames": len(audio),
        "sample_rates_hz": sorted({f.sample_rate for f in audio}),
        "channels": sorted({f.num_channels for f in audio}),
        "bytes_per_context": list(per_context.values()),  # in the order the contexts played
        "down": dict(Counter(type(f).__name__ for f in down)),
        "errors": [f.error for f in [*down, *up] if isinstance(f, ErrorFrame)],
    }


if __name__ == "__main__":
    url, voice = sys.argv[1], sys.argv[2]
    rate_hz = int(sys.argv[3]) if len(sys.argv) > 3 else 24000
    print(json.dumps(asyncio.run(speak(url, voice, rate_hz))))
