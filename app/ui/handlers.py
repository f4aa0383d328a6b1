"""Event handlers of the studio page (and of its Gradio API): validate, synthesise, stream, save voices.

`Handlers(service).synthesize` is the `synthesize` API event: an async generator whose keyword
parameters are the API's (text, prompt_audio, prompt_text, mode, instruct_text, voice, seed, speed,
stream). While streaming it yields each chunk as 16-bit PCM WAV bytes at a fixed scale (never float
arrays: Gradio would peak-normalise each chunk on its own); at the end it yields the whole WAV, the
per-request stats line and the details, built from the request's metrics record by `stats_line` and
`request_details` (the low-latency player's result uses the same two, through GET /studio/requests/{id}).
Stop cancels the event: Gradio cancels the task and closes
this generator, which closes `service.stream` -> `Synthesizer.stream` -> the LM stream (vLLM abort).
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import gradio as gr
import numpy as np

from app.audio import OUTPUT_SAMPLE_RATE_HZ, wav_bytes
from app.engine.admission import BusyError
from app.engine.inputs import MAX_SEED, InputError
from app.engine.metrics import RequestRecord
from app.engine.pipeline import EmptyTextError
from app.engine.prepare import SpeechInputs, prepare, reference_voice
from app.engine.service import NotReadyError, StudioService
from app.engine.voices import VoiceError

# live chunks go to the player in pieces of at most 0.25 s: hls.js starts playing once a few HLS
# segments exist, and Gradio cuts one segment per yield, so small pieces start playback sooner
LIVE_PIECE = OUTPUT_SAMPLE_RATE_HZ // 4
ARRIVAL_KEY = "studio_arrived_at"  # request-state key set by ArrivalStamp (time.monotonic())
NO_FFMPEG_NOTE = "ffmpeg is not installed: live playback is off, the final WAV plays when done"


class ArrivalStamp:
    """ASGI middleware: stamps each request's arrival, so a handler can tell how long it queued."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})[ARRIVAL_KEY] = time.monotonic()
        await self.app(scope, receive, send)


def queue_wait_s(request: gr.Request | None, now: float) -> float:
    """Seconds between the queue-join HTTP request's arrival and `now` (0 where unknown)."""
    raw = getattr(request, "request", None) if request is not None else None
    arrived = getattr(raw, "scope", {}).get("state", {}).get(ARRIVAL_KEY) if raw is not None else None
    return max(0.0, now - arrived) if arrived is not None else 0.0


def live_playback() -> bool:
    """Gradio encodes streamed audio with ffmpeg; without it only the final WAV can play."""
    return shutil.which("ffmpeg") is not None


def _error(e: BaseException, *paths: str | None) -> gr.Error:
    """A gr.Error with the message of `e`, server paths reduced to their file names."""
    msg = str(e)
    for p in paths:
        if p:
            msg = msg.replace(str(p), Path(p).name)
    return gr.Error(msg)


def stats_line(rec: RequestRecord) -> str:
    """The per-request line under the player: latency, speed and where the time went (both players)."""
    rtf = rec.rtf if rec.rtf is not None else float("inf")
    return (f"**TTFA** {rec.ttfa_ms or 0:.0f} ms · **RTF** {rtf:.2f} · **{rec.tokens_per_s or 0:.1f}** tokens/s · "
            f"**audio** {rec.audio_s or 0:.2f} s · LM {rec.lm_s or 0:.2f} s · flow {rec.flow_s or 0:.2f} s · "
            f"vocoder {rec.vocoder_s or 0:.2f} s · queue {rec.queue_wait_s:.2f} s · "
            f"reference {rec.reference_s:.2f} s · mode {rec.mode} · seed {rec.seed}")


def notes_markdown(notes: tuple[str, ...] | list[str]) -> str:
    """The notes as a Markdown list below the stats line ("" for none)."""
    return "\n\n" + "\n".join(f"- {n}" for n in notes) if notes else ""


def request_details(rec: RequestRecord) -> dict[str, Any]:
    """The details JSON of one finished request (the page's "details" output, both players)."""
    def r(x: float | None, digits: int) -> float | None:
        return None if x is None else round(x, digits)

    return {"seed": rec.seed, "mode": rec.mode, "stream": rec.stream, "speed": rec.speed, "voice": rec.voice or None,
            "request_id": rec.request_id, "sample_rate": OUTPUT_SAMPLE_RATE_HZ, "audio_samples": rec.n_samples,
            "audio_s": r(rec.audio_s, 3), "ttfa_ms": r(rec.ttfa_ms, 1), "rtf": r(rec.rtf, 3), "tokens": rec.n_tokens,
            "tokens_per_s": r(rec.tokens_per_s, 1), "lm_s": r(rec.lm_s, 3), "flow_s": r(rec.flow_s, 3),
            "vocoder_s": r(rec.vocoder_s, 3), "queue_wait_s": round(rec.queue_wait_s, 3),
            "reference_s": round(rec.reference_s, 3), "chunks": rec.n_chunks, "segments": rec.n_segments,
            "notes": list(rec.notes)}


class Handlers:
    """The page's callbacks, bound to the process's `StudioService`."""

    def __init__(self, service: StudioService) -> None:
        self.service = service
        self.cfg = service.cfg

    # --- synthesis -----------------------------------------------------------------------------

    async def synthesize(self, text: str, prompt_audio: str | None, prompt_text: str, mode: str,
                         instruct_text: str, voice: str | None, seed: float | None, speed: float, stream: bool,
                         request: gr.Request = None):
        """Speak `text` in the reference voice; yields (live chunk, final WAV, stats line, details)."""
        t_start = time.monotonic()
        queue_s = queue_wait_s(request, t_start)
        stream = bool(stream)
        try:
            prepared = await prepare(self.service, SpeechInputs(
                text=text, voice=voice or None, reference=prompt_audio or None, transcript=prompt_text,
                mode=mode, instruct_text=instruct_text, seed=seed, speed=speed, stream=stream))
        except NotReadyError as e:
            raise gr.Error(str(e), title="Not ready") from e
        except InputError as e:
            raise gr.Error(str(e)) from e
        req = prepared.request
        for note in prepared.notes:
            gr.Warning(note[0].upper() + note[1:])
        live = stream and live_playback()
        if stream and not live:  # shown with the stats, so it goes into the request's record
            prepared = replace(prepared, notes=(*prepared.notes, NO_FFMPEG_NOTE))

        parts: list[np.ndarray] = []
        n_samples = 0
        try:
            async with contextlib.AsyncExitStack() as stack:
                queue_s += await stack.enter_async_context(self.service.admission.admit())  # the process's one
                chunks = await stack.enter_async_context(contextlib.aclosing(
                    self.service.stream(req, queue_wait_s=queue_s, prepared=prepared)))
                async for chunk in chunks:
                    if not chunk.samples.size:
                        continue
                    parts.append(chunk.samples)
                    n_samples += chunk.samples.size
                    if live:
                        progress = f"streaming… {n_samples / OUTPUT_SAMPLE_RATE_HZ:.2f} s"
                        for piece in np.split(chunk.samples, range(LIVE_PIECE, chunk.samples.size, LIVE_PIECE)):
                            yield wav_bytes(piece, OUTPUT_SAMPLE_RATE_HZ), gr.skip(), progress, gr.skip()
        except BusyError as e:
            raise gr.Error(str(e), title="Busy") from e
        except EmptyTextError as e:
            raise gr.Error(str(e)) from e
        except NotReadyError as e:
            raise gr.Error(str(e), title="Not ready") from e
        except ValueError as e:  # e.g. a prompt longer than the engine's max_model_len
            raise gr.Error(f"Synthesis failed: {e}") from e
        # the stream has ended (its final chunk came), so its record is in the metrics: the same
        # builders as the low-latency player's (GET /studio/requests/{id}, app/server/studio_stream.py)
        rec = self.service.metrics.record(req.request_id)
        assert rec is not None and rec.outcome == "ok", rec
        audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        line = stats_line(rec) + notes_markdown(rec.notes)
        yield (gr.skip() if live else None), wav_bytes(audio, OUTPUT_SAMPLE_RATE_HZ), line, request_details(rec)

    @staticmethod
    def random_seed() -> int:
        return secrets.randbelow(MAX_SEED + 1)

    # --- saved voices --------------------------------------------------------------------------

    async def save_voice(self, name: str, prompt_audio: str | None, prompt_text: str,
                         replace: bool = False) -> tuple[str, str]:
        """Compute the reference's features and store them under `name`; a voice of that name is replaced
        only with `replace` (the page's "Replace a saved voice of that name" box), else refused.

        Returns (message, the saved name).
        """
        try:
            self.service.require_ready()
        except NotReadyError as e:
            raise gr.Error(str(e), title="Not ready") from e
        if not prompt_audio:
            raise gr.Error("Upload or record the reference clip to save first.")
        try:
            features = await reference_voice(self.service, prompt_audio, prompt_text)
            info = self.service.voices.save(name or "", features, overwrite=bool(replace))
        except VoiceError as e:
            if "exists already" in str(e):
                raise gr.Error(f"{e}. Tick \"Replace a saved voice of that name\" to overwrite it.",
                               title="Name taken") from e
            raise _error(e, prompt_audio) from e
        except (InputError, OSError) as e:
            raise _error(e, prompt_audio) from e
        note = "" if info.prompt_text else " (no transcript: it will speak in cross-lingual mode)"
        notes = "".join(f"\n\n- {n}" for n in features.notes)
        return f"Saved voice **{info.name}** ({info.prompt_seconds:.1f} s){note}.{notes}", info.name

    def delete_voice(self, voice: str | None) -> tuple[str, str]:
        """Delete the saved voice `voice`. Returns (message, "")."""
        if not voice:
            raise gr.Error("Pick a saved voice to delete.")
        try:
            self.service.voices.delete(voice)
        except VoiceError as e:
            raise gr.Error(str(e)) from e
        return f"Deleted voice **{voice}**.", ""

    def list_voices(self) -> list[dict]:
        """The saved voices of the loaded model: name, transcript, length, creation time."""
        return [v.to_dict() for v in self.service.voices.list()]

    def voice_choices(self, current: str | None = "") -> gr.Dropdown:
        """The dropdown's choices, refreshed from the store (keeps `current` if it still exists)."""
        names = self.service.voices.names()
        return gr.Dropdown(choices=["", *names], value=current if current in names else "")

    # --- status --------------------------------------------------------------------------------

    def status(self):
        """(status line, banner, timer): polled until the service is ready or failed."""
        s = self.service
        if s.ready:
            facts = s.facts()
            text = (f"**Status:** ready · backend `{facts.get('backend', '?')}` · device `{facts.get('device')}` · "
                    f"model `{facts.get('model_dir')}`")
        elif s.error:
            text = f"**Status:** failed to start: {s.error}"
        else:
            text = f"**Status:** {s.status}…  (synthesis is available once the model is ready)"
        if not live_playback():
            text += "  \nffmpeg is not installed: live playback is off (the final WAV still plays)."
        banner = gr.Markdown(visible=s.random_model, value=(
            "### ⚠️ Running on a generated tiny random model: the output is noise\n"
            f"No model folder was given and `{self.cfg.model.repo_id}` could not be downloaded. Point the app at "
            "real weights with `python app.py --model-dir /path/to/CosyVoice2-0.5B` (or `COSYVOICE_MODEL_DIR`), "
            "or start it with internet access to download them.") if s.random_model else "")
        return text, banner, gr.Timer(active=not (s.ready or s.error))
