"""One reading of why a request was refused, for every door (issue 28: `prepare` and `speak` raise, each
door renders; none classifies on its own). A `Refusal` carries what the HTTP doors answer with (status,
code, Retry-After, the input field at fault) and what the page shows (a pop-up title and the message).
Exceptions that are not refusals (bugs) give None: the door lets them propagate."""

from __future__ import annotations

from dataclasses import dataclass

from app.engine.pipeline import EmptyTextError
from app.message import Message, said
from app.service.admission import BusyError
from app.service.fair_share import ShareError
from app.service.inputs import InputError
from app.service.service import EngineDeadError, GpuOutOfMemoryError, NotReadyError
from app.service.voice_file import VoiceFileError
from app.service.voices import VoiceError

RETRY_AFTER_S = 2  # busy / not ready / out of memory: worth retrying at once
ENGINE_RETRY_AFTER_S = 30  # a dead engine restarts in 15-60 s
# a saved voice's VoiceError.code -> (status, code, title, field); any other (invalid_name): 400 on the name
VOICE_REFUSALS = {"exists": (409, "voice_exists", "Name taken", "name"),
                  "not_found": (404, "voice_not_found", "Error", "voice"),
                  **dict.fromkeys(("damaged", "other_model"), (409, "voice_unusable", "Error", "voice")),
                  "invalid_transcript": (400, "invalid_value", "Error", "prompt_text"),
                  # the store's folder cannot be written (read-only, full): 507 Insufficient Storage, no field
                  "unwritable": (507, "voices_unwritable", "Cannot save", None)}


@dataclass(frozen=True)
class Refusal:
    status: int  # HTTP status
    code: str  # machine-readable, OpenAI-style `error.code`
    message: str  # for people: the page's pop-up and the API's `error.message`
    title: str = "Error"  # the page's pop-up title (Gradio's default)
    retry_after_s: float | None = None
    param: str | None = None  # prepare()'s name of the input at fault; each door maps it to its own field


def refusal(e: BaseException) -> Refusal | None:
    """The refusal `e` stands for, or None when `e` is not one (subclasses before their bases)."""
    msg = said(e)  # a Message keeps its key for the page's language
    if isinstance(e, InputError):
        return Refusal(400, e.code, msg, param=e.param)
    if isinstance(e, VoiceFileError):  # a .cvvoice file: its own code (other_model, file_too_large, ...)
        return Refusal(413 if e.code == "file_too_large" else 400, e.code, msg, param="file")
    if isinstance(e, VoiceError):
        status, code, title, param = VOICE_REFUSALS.get(e.code, (400, "invalid_value", "Error", "name"))
        return Refusal(status, code, msg, title, param=param)
    if isinstance(e, EmptyTextError):
        return Refusal(400, "empty_text", msg, param="text")
    if isinstance(e, ShareError):
        return Refusal(429, "client_share_exceeded", msg, "Your share is in use", e.retry_after_s)
    if isinstance(e, BusyError):
        return Refusal(503, "server_busy", msg, "Busy", RETRY_AFTER_S)
    if isinstance(e, EngineDeadError):
        return Refusal(503, "engine_dead", msg, "Not ready", ENGINE_RETRY_AFTER_S)
    if isinstance(e, NotReadyError):
        return Refusal(503, "not_ready", msg, "Not ready", RETRY_AFTER_S)
    if isinstance(e, GpuOutOfMemoryError):
        return Refusal(503, "gpu_out_of_memory", Message("failed", "Synthesis failed: {error}", error=e),
                       retry_after_s=RETRY_AFTER_S)
    if isinstance(e, ValueError):  # e.g. the prompt plus the output does not fit the engine's max_model_len
        return Refusal(400, "invalid_request", Message("failed", "Synthesis failed: {error}", error=e))
    return None
