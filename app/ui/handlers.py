"""Event handlers of the studio page and its Gradio API: validate, transcribe, synthesise (the API's), save,
export and import voices. Design notes: docs/design.md."""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import gradio as gr
import numpy as np

from app.audio import OUTPUT_SAMPLE_RATE_HZ, AudioError, decode_audio, wav_bytes
from app.message import Message, lang_of, said_without, say
from app.service import voice_door
from app.service.asr import AsrUnavailable
from app.service.inputs import InputError, check_transcript
from app.service.owners import ARRIVAL_KEY, CALLER_KEY, NOBODY, Caller, Owner
from app.service.prepare import HEARD_NOTHING_NOTE, SpeechInputs, prepare
from app.service.refusals import refusal
from app.service.service import NotReadyError, StudioService
from app.service.voice_file import SUFFIX
from app.service.voices import VoiceError
from app.ui.i18n import error, t, title_in
from app.ui.takes import take_line, wav_name

READY_STATUS_S = 5.0  # the status line's poll once ready: a later engine death shows within this
NO_VOICE = ("(none: use the recording above)", "")  # the voice dropdown's first choice: no saved voice
# each yield of the API's `synthesize`: (a chunk's WAV, the final WAV, stats or progress line, details), the WAVs
# as FileData dicts (Gradio copies them to its cache, the client downloads them)
Take = tuple[dict | None, dict | None, str, dict | None]
log = logging.getLogger(__name__)


def request_state(request: gr.Request | None) -> Any:
    """Starlette's `request.state` behind a page event, filled by the server's gate (None without one)."""
    return getattr(getattr(request, "request", None), "state", None)


def found_caller(request: gr.Request | None) -> Caller:
    """The Caller the server's gate found for the HTTP request behind a page event (nobody's without one)."""
    return getattr(request_state(request), CALLER_KEY, NOBODY)


def caller(request: gr.Request | None, profile: gr.OAuthProfile | None = None) -> Caller:
    """A page event's Caller: the Hugging Face user Gradio hands it on a Space with hf_oauth (the client too), the
    page's login user (its share per address: one password is often a group's), else the server's for it."""
    found = found_caller(request)
    if profile is not None:
        return Caller(Owner(f"hf:{profile.username}"), f"hf:{profile.username}", found.admin)
    if login_user := getattr(request, "username", None):
        return Caller(Owner(f"user:{login_user}"), found.client, found.admin)
    return found


def viewer(request: gr.Request | None, profile: gr.OAuthProfile | None, admins: frozenset[str]
           ) -> frozenset[str] | None:
    """Whose requests and facts a page event may show: None = everything (an admin: the admin key, this machine,
    a user of `[server] admin_users`), else the caller's owner ids (the page's and its HTTP request's)."""
    me = caller(request, profile)
    if me.admin or me.owner.id in admins:
        return None
    ids = {me.owner.id, found_caller(request).owner.id} - {""}
    return frozenset(ids or {""})  # "": nobody is told apart (shared scope), so every request is everybody's


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


def wav_file(samples: np.ndarray, path: Path) -> dict:
    """`samples` ([N] float32, 24 kHz) written to `path` as a WAV, as the FileData dict the API returns."""
    path.write_bytes(wav_bytes(samples, OUTPUT_SAMPLE_RATE_HZ))
    return gr.FileData(path=str(path), orig_name=path.name, mime_type="audio/wav").model_dump()


class Handlers:
    """The page's callbacks, bound to the process's `StudioService`."""

    def __init__(self, service: StudioService) -> None:
        self.service = service

    # --- synthesis (the Gradio API's; the page plays through /studio/speech) ------------------------

    async def synthesize(self, text: str, prompt_audio: dict | None = None, prompt_text: str = "",
                         mode: str = "zero_shot", instruct_text: str = "", voice: str = "", seed: float | None = 0,
                         speed: float = 1.0, stream: bool = True, dialogue: bool = False,
                         request: gr.Request = None, profile: gr.OAuthProfile | None = None
                         ) -> AsyncIterator[Take]:
        """Speak `text` in the reference voice (`prompt_audio`: the uploaded file's FileData) or the saved
        `voice`. Streamed, each chunk comes as a WAV of its own; the last yield is (None, the final WAV named
        after the voice and text (`wav_name`), stats line, details). A cancelled job aborts the request."""
        arrived = getattr(request_state(request), ARRIVAL_KEY, None)  # the queue-join request's arrival
        queue_s = max(0.0, time.monotonic() - arrived) if arrived is not None else 0.0
        lang, me = lang_of(request), caller(request, profile)
        try:
            prepared = await prepare(self.service, SpeechInputs(
                text=text, voice=voice or None, reference=(prompt_audio or {}).get("path") or None,
                transcript=prompt_text, mode=mode, instruct_text=instruct_text, seed=seed, speed=speed,
                stream=bool(stream), owner=me.owner, dialogue=bool(dialogue)))
        except (NotReadyError, InputError) as e:
            raise page_error(e, lang) from e
        for note in prepared.notes:  # as warnings, capitalised
            note = say(note, lang)
            gr.Warning(note[0].upper() + note[1:])
        req, parts = prepared.request, []
        # the WAVs' folder goes once Gradio has copied each yielded file to its cache
        with tempfile.TemporaryDirectory(prefix="take-", ignore_cleanup_errors=True) as folder:
            try:
                async with self.service.speak(req, prepared=prepared, caller=me, queue_wait_s=queue_s) as (_, chunks):
                    async for chunk in chunks:
                        parts.append(chunk.samples)
                        if req.stream and chunk.samples.size:
                            seconds = sum(map(len, parts)) / OUTPUT_SAMPLE_RATE_HZ
                            yield (wav_file(chunk.samples, Path(folder) / f"chunk-{len(parts)}.wav"), None,
                                   say(Message("streaming", "streaming… {seconds:.2f} s", seconds=seconds), lang), None)
            except Exception as e:
                raise page_error(e, lang) from e
            # the stream has ended (its final chunk came), so its record is in the metrics
            rec = self.service.metrics.record(req.request_id)
            assert rec is not None and rec.outcome == "ok", rec
            audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
            yield (None, wav_file(audio, Path(folder) / wav_name(text, voice)),
                   take_line(rec.details(), lang, rec.notes), rec.details())

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
        banner = gr.Markdown(visible=s.random_model,
                             value=t(lang, "banner", repo=s.cfg.model.repo_id) if s.random_model else "")
        # polled fast while loading or restarting, then slowly: an engine that dies later is still told
        period = s.cfg.ui.status_refresh_s if fault or not s.ready else READY_STATUS_S
        return text, banner, gr.Timer(period, active=not s.error)
