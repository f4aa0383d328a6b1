"""Event handlers of the studio page (and of its Gradio API): validate, transcribe, synthesise, stream, save,
export and import voices. Design notes: docs/design.md."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import gradio as gr
import numpy as np

from app.audio import OUTPUT_SAMPLE_RATE_HZ, AudioError, decode_audio, wav_bytes
from app.message import Message, said_without
from app.server.identity import caller_of, page_caller
from app.server.limits import ARRIVAL_KEY
from app.service import voice_door
from app.service.asr import AsrUnavailable
from app.service.inputs import InputError, check_transcript
from app.service.owners import Caller
from app.service.prepare import HEARD_NOTHING_NOTE, SpeechInputs, prepare
from app.service.refusals import refusal
from app.service.service import NotReadyError, StudioService
from app.service.voice_file import SUFFIX
from app.service.voices import VoiceError
from app.ui.i18n import error, lang_of, say, t, title_in
from app.ui.stop import StopSignal, until_stopped
from app.ui.takes import stopped_take, take_line, wav_name

# live chunks go to the player in pieces of at most 0.25 s: hls.js starts playing once a few HLS
# segments exist, and Gradio cuts one segment per yield, so small pieces start playback sooner
LIVE_PIECE = OUTPUT_SAMPLE_RATE_HZ // 4
NO_FFMPEG_NOTE = Message("no_ffmpeg_note", "ffmpeg is not installed: live playback is off, the final WAV plays when "
                         "done")
READY_STATUS_S = 5.0  # the status line's poll once ready: a later engine death shows within this
NO_VOICE = ("(none: use the recording above)", "")  # the voice dropdown's first choice: no saved voice
log = logging.getLogger(__name__)


def request_scope(request: gr.Request | None) -> dict:
    """The ASGI scope of the HTTP request behind a page event ({} without one)."""
    return getattr(getattr(request, "request", None), "scope", None) or {}


def caller(request: gr.Request | None, profile: gr.OAuthProfile | None = None) -> Caller:
    """A page event's Caller (app/server/identity.py:page_caller): the Hugging Face profile Gradio hands the
    handlers on a Space with hf_oauth, the page's login user, else what the server found for its request."""
    return page_caller(request_scope(request), profile.username if profile is not None else None,
                       getattr(request, "username", None))


def viewer(request: gr.Request | None, profile: gr.OAuthProfile | None, admins: frozenset[str]
           ) -> frozenset[str] | None:
    """Whose requests and facts a page event may show: None = everything (an admin: the admin key, this machine,
    a user of `[server] admin_users`), else the caller's owner ids (the page's and its HTTP request's)."""
    me = caller(request, profile)
    if me.admin or me.owner.id in admins:
        return None
    ids = {me.owner.id, caller_of(request_scope(request)).owner.id} - {""}
    return frozenset(ids or {""})  # "": nobody is told apart (shared scope), so every request is everybody's


def live_playback() -> bool:
    """Gradio encodes streamed audio with ffmpeg; without it only the final WAV can play."""
    return shutil.which("ffmpeg") is not None


def page_error(e: Exception, lang: str = "en") -> gr.Error:
    """A refusal (app/service/refusals.py) as the page's pop-up in `lang`: its title and message, no traceback in
    the log (one line for a refused input); `e` itself when it is not a refusal (a bug: Gradio logs it)."""
    r = refusal(e)
    if r is None:
        raise e
    if r.status == 400:
        log.info("refused input: %s", r.message)
    message = r.message if r.code != "voice_exists" else Message(  # what the page adds: its own box
        "voice_exists_page", "{error}. Replace it: tick \"Replace a saved voice of that name\" on the page, or pass "
        "overwrite=True through the API.", error=r.message)
    return error(message, lang, r.title)


class Handlers:
    """The page's callbacks, bound to the process's `StudioService`."""

    def __init__(self, service: StudioService) -> None:
        self.service = service

    # --- synthesis -----------------------------------------------------------------------------

    async def synthesize(self, text: str, prompt_audio: str | None, prompt_text: str, mode: str,
                         instruct_text: str, voice: str | None, seed: float | None, speed: float, stream: bool,
                         dialogue: bool = False, stop: StopSignal | None = None, request: gr.Request = None,
                         profile: gr.OAuthProfile | None = None):
        """Speak `text` in the reference voice; yields (live chunk, final WAV, stats line, details).

        The final WAV is a file named after the voice and text (`wav_name`). After the page's Stop
        (`stop`) it holds the audio made until then, and the stats line says it was stopped."""
        arrived = request_scope(request).get("state", {}).get(ARRIVAL_KEY)  # the queue-join request's arrival
        queue_s = max(0.0, time.monotonic() - arrived) if arrived is not None else 0.0
        lang = lang_of(request)  # the lines a page user reads; API clients (no cookie) get English
        stream = bool(stream)
        me = caller(request, profile)
        stop = stop if stop is not None else StopSignal()
        if stop.stopped:  # Stop while this request waited in the queue
            yield None, None, say(Message("stopped_before", "Stopped before it started."), lang), None
            return
        try:
            try:
                prepared = await prepare(self.service, SpeechInputs(
                    text=text, voice=voice or None, reference=prompt_audio or None, transcript=prompt_text, mode=mode,
                    instruct_text=instruct_text, seed=seed, speed=speed, stream=stream, owner=me.owner,
                    dialogue=bool(dialogue)))
            except (NotReadyError, InputError) as e:
                raise page_error(e, lang) from e
            for note in prepared.notes:  # as warnings, capitalised
                note = say(note, lang)
                gr.Warning(note[0].upper() + note[1:])
            live = stream and live_playback()
            if stream and not live:  # shown with the stats, so it goes into the request's record
                prepared = replace(prepared, notes=(*prepared.notes, NO_FFMPEG_NOTE))
            parts: list[np.ndarray] = []
            try:
                async with self.service.speak(prepared.request, prepared=prepared, caller=me, queue_wait_s=queue_s,
                                              stop=stop.event) as (_, chunks), \
                        contextlib.aclosing(until_stopped(chunks, stop)) as until:
                    async for chunk in until:
                        parts.append(chunk.samples)
                        if live and chunk.samples.size:
                            progress = say(Message("streaming", "streaming… {seconds:.2f} s",
                                                   seconds=sum(map(len, parts)) / OUTPUT_SAMPLE_RATE_HZ), lang)
                            for piece in np.split(chunk.samples, range(LIVE_PIECE, chunk.samples.size, LIVE_PIECE)):
                                yield wav_bytes(piece, OUTPUT_SAMPLE_RATE_HZ), gr.skip(), progress, gr.skip()
            except Exception as e:
                raise page_error(e, lang) from e
            audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
            # the named final WAV; its folder goes once Gradio has copied the yielded file to its cache
            with tempfile.TemporaryDirectory(prefix="take-", ignore_cleanup_errors=True) as folder:
                path = Path(folder) / wav_name(text, voice)
                path.write_bytes(wav_bytes(audio, OUTPUT_SAMPLE_RATE_HZ))
                yield self._result(prepared.request, audio, path, stop, live, lang)
        except gr.Error as e:  # the message, as the pop-up says it (in `lang`), also into the details: the page's
            # failure listener puts it next to Generate (app/ui/player_failure.js)
            yield gr.skip(), gr.skip(), gr.skip(), {"error": e.message}
            raise

    def _result(self, req, audio: np.ndarray, path: Path, stop: StopSignal, live: bool, lang: str) -> tuple:
        # the take's last outputs. The stream has ended (its final chunk came, or Stop), so its record is in the
        # metrics: the same builders as the low-latency player's (app/ui/player.py PlayerTake.show)
        if stop.stopped:
            details = stopped_take(req.request_id, req.seed, int(audio.size), req.mode)
            # the live player is reset (no buffered audio plays on), the take so far is the final WAV
            return None, (str(path) if audio.size else None), take_line(details, lang), details
        rec = self.service.metrics.record(req.request_id)
        assert rec is not None and rec.outcome == "ok", rec
        return (gr.skip() if live else None), str(path), take_line(rec.details(), lang, rec.notes), rec.details()

    @staticmethod
    async def begin(stop: StopSignal) -> tuple[Any, ...]:
        """Generate with the standard player, before it queues: clear the Stop and the previous take's
        outputs (live player, final WAV, stats, details), so nothing stale can be played or downloaded."""
        stop.event.clear()
        return None, None, "", None

    @staticmethod
    async def stop(stop: StopSignal) -> None:
        """The page's Stop: the session's running (or queued) `synthesize` ends and keeps what it made."""
        stop.event.set()

    @staticmethod
    def check_upload(prompt_audio: str | None, request: gr.Request = None) -> str | None:
        """A reference just uploaded: refuse (and clear) a file that is not audio, with the reason (in the page's
        language)."""
        try:
            if prompt_audio:
                decode_audio(prompt_audio)
        except (AudioError, OSError) as e:
            msg = said_without(e, prompt_audio)
            log.info("refused upload: %s", msg)
            lang = lang_of(request)
            gr.Warning(say(msg, lang), title=title_in("Not an audio file", lang))
            return None
        return prompt_audio

    async def _transcribe(self, prompt_audio: str, lang: str, progress: gr.Progress, retry: bool) -> str:
        """The clip's cleaned transcript, said found in a pop-up; `AsrUnavailable` as it comes."""
        model = self.service.asr.cfg.model_id

        def report(done: int, total: int) -> None:  # from the download thread: Gradio's progress is thread-safe
            progress(done / total, desc=t(lang, "downloading", model=model, done=done / 1e9, total=total / 1e9))

        progress(None, desc=t(lang, "transcribing"))
        got = await self.service.asr.transcribe(prompt_audio, report=report, retry=retry)
        limit = self.service.cfg.limits.max_transcript_chars
        text = check_transcript(got.text[:limit], limit)
        if text:
            gr.Info(t(lang, "transcribed", language=got.language))
        return text

    async def transcribe(self, prompt_audio: str | None, request: gr.Request = None,
                         progress: gr.Progress = gr.Progress()) -> str:  # noqa: B008 (Gradio's injection idiom)
        """Whisper's transcript of `prompt_audio` (retries a model that failed to load before)."""
        lang = lang_of(request)
        if not prompt_audio:
            raise error(t(lang, "need_audio"), lang)
        try:
            text = await self._transcribe(prompt_audio, lang, progress, retry=True)
        except AsrUnavailable as e:
            raise error(e, lang) from e
        if not text:
            raise error(HEARD_NOTHING_NOTE, lang)
        return text

    async def fill(self, prompt_audio: str | None, prompt_text: str | None, mode: str | None = None,
                   voice: str | None = None, request: gr.Request = None,
                   progress: gr.Progress = gr.Progress()):  # noqa: B008
        """The transcript box after Generate / Save voice: Whisper's words for a blank one, else unchanged. Save
        passes no mode or voice (Gradio fills in the defaults): a saved voice keeps its transcript whatever the mode."""
        limit = self.service.cfg.limits.max_transcript_chars
        if (not prompt_audio or voice or mode not in (None, "", "zero_shot") or check_transcript(prompt_text, limit)
                or not self.service.asr.cfg.enabled):
            return gr.skip()
        try:
            text = await self._transcribe(prompt_audio, lang_of(request), progress, retry=False)
        except AsrUnavailable:  # synthesis / the save says why in its notes, and falls back to cross-lingual
            return gr.skip()
        return text or gr.skip()

    # --- saved voices --------------------------------------------------------------------------

    async def save_voice(self, name: str, prompt_audio: str | None, prompt_text: str, overwrite: bool = False,
                         request: gr.Request = None, profile: gr.OAuthProfile | None = None) -> tuple[str, str]:
        """Compute the reference's features and store them under `name` among the caller's voices; returns
        (message, the saved name). A voice of that name is replaced only with `overwrite` (the page's
        "Replace a saved voice..." box), else refused."""
        lang = lang_of(request)  # the message and each note (features.notes) in the page's language
        if not prompt_audio:
            raise error(Message("need_clip_to_save", "Upload or record the reference clip to save first."), lang)
        try:
            info, found = await voice_door.save(self.service, caller(request, profile).owner, name or "",
                                                prompt_audio, prompt_text, overwrite=bool(overwrite))
        except OSError as e:
            raise error(said_without(e, prompt_audio), lang) from e
        except (VoiceError, InputError, NotReadyError) as e:
            raise page_error(e, lang) from e
        done = (Message("saved_voice", "Saved voice **{name}** ({seconds:.1f} s).", name=info.name,
                        seconds=info.prompt_seconds) if info.prompt_text else
                Message("saved_voice_cross", "Saved voice **{name}** ({seconds:.1f} s) (no transcript: it will speak "
                        "in cross-lingual mode).", name=info.name, seconds=info.prompt_seconds))
        return say(done, lang) + "".join(f"\n\n- {say(n, lang)}" for n in found), info.name

    def delete_voice(self, voice: str | None, request: gr.Request = None,
                     profile: gr.OAuthProfile | None = None) -> tuple[str, str]:
        """Delete the caller's saved voice `voice`. Returns (message, "")."""
        lang = lang_of(request)
        if not voice:
            raise error(Message("pick_to_delete", "Pick a saved voice to delete."), lang)
        try:
            voice_door.delete(self.service, caller(request, profile).owner, voice)
        except VoiceError as e:
            raise page_error(e, lang) from e
        return say(Message("deleted_voice", "Deleted voice **{name}**.", name=voice), lang), ""

    async def export_voice(self, voice: str | None, request: gr.Request = None,
                           profile: gr.OAuthProfile | None = None) -> AsyncIterator[str]:
        """The caller's saved voice `voice` as a `<name>.cvvoice` file (its path; docs/api.md: the format).
        A generator so that its folder goes once Gradio has copied the file (no file left per click)."""
        lang = lang_of(request)
        if not voice:
            raise error(Message("pick_to_export", "Pick a saved voice to export."), lang)
        try:
            info, data = await asyncio.to_thread(voice_door.export, self.service, caller(request, profile).owner,
                                                 voice)
        except VoiceError as e:
            raise page_error(e, lang) from e
        with tempfile.TemporaryDirectory(prefix="voice-", ignore_cleanup_errors=True) as folder:
            path = Path(folder) / f"{info.name}{SUFFIX}"
            path.write_bytes(data)
            yield str(path)

    async def import_voice(self, file: str | None, overwrite: bool = False, request: gr.Request = None,
                           profile: gr.OAuthProfile | None = None) -> tuple[str, str]:
        """Add the voice in a `.cvvoice` file to the caller's voices under the file's name; returns (message,
        its name). A voice of that name is replaced only with `overwrite`, else refused."""
        lang = lang_of(request)
        if not file:
            raise error(Message("choose_voice_file", "Choose a .cvvoice file to import."), lang)
        try:
            info = await voice_door.import_file(self.service, caller(request, profile).owner, file,
                                                overwrite=bool(overwrite))
        except OSError as e:  # its message would name the server's upload folder
            raise error(Message("voice_file_unread", "the voice file could not be read; upload it again"), lang) from e
        except (VoiceError, NotReadyError) as e:
            raise page_error(e, lang) from e
        done = Message("imported_voice", "Imported voice **{name}** ({seconds:.1f} s).", name=info.name,
                       seconds=info.prompt_seconds)
        return say(done, lang), info.name

    def list_voices(self, request: gr.Request = None, profile: gr.OAuthProfile | None = None) -> list[dict]:
        """The caller's saved voices of the loaded model: name, transcript, length, creation time."""
        return [{k: v for k, v in info.to_dict().items() if k != "owner"}
                for info in self.service.voices.visible(caller(request, profile).owner)]

    def voice_choices(self, current: str | None = "", request: gr.Request = None,
                      profile: gr.OAuthProfile | None = None) -> gr.Dropdown:
        """The dropdown's choices: the caller's voices (keeps `current` if it still exists)."""
        names = self.service.voices.of(caller(request, profile).owner).names()  # each page load
        return gr.Dropdown(choices=[NO_VOICE, *names], value=current if current in names else "")

    def stats(self, details: dict | None, request: gr.Request = None) -> Any:
        """The take's stats line again, in the page's language (the language switch): from the details box, its
        notes from the request's record while the metrics keep it; unchanged while no take is shown."""
        if not isinstance(details, dict) or "request_id" not in details:
            return gr.skip()
        rec = self.service.metrics.record(str(details["request_id"]))
        return take_line(details, lang_of(request), rec.notes if rec is not None else None)

    # --- status --------------------------------------------------------------------------------

    def status(self, request: gr.Request = None):
        """(status line, banner, timer): polled until the service is ready or failed; in the page's language."""
        s, lang = self.service, lang_of(request)
        fault = s.engine_fault() if s.ready else None  # a dead engine, restarting: said until it serves again
        if fault:
            text = t(lang, "status_engine", fault=say(fault, lang))
        elif s.ready:
            facts = s.facts()
            text = t(lang, "status_ready", backend=facts.get("backend", "?"), device=facts.get("device"),
                     model=s.model_name())  # the name, never the server's path
        elif s.error:
            text = t(lang, "status_failed", error=say(s.error, lang))
        else:
            text = t(lang, "status_loading", status=say(s.status, lang))
        if not live_playback():
            text += "  \n" + t(lang, "no_ffmpeg")
        banner = gr.Markdown(visible=s.random_model,
                             value=t(lang, "banner", repo=s.cfg.model.repo_id) if s.random_model else "")
        # polled fast while loading or restarting, then slowly: an engine that dies later is still told
        period = s.cfg.ui.status_refresh_s if fault or not s.ready else READY_STATUS_S
        return text, banner, gr.Timer(period, active=not s.error)
