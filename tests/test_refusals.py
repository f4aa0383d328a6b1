"""One reading of refusals for every door (app/service/refusals.py): the HTTP doors' status, code,
Retry-After and field, and the page's pop-up title and message, from the same `Refusal`; a bug is no
refusal and propagates from both."""

from __future__ import annotations

import logging

import gradio as gr
import pytest

from app.engine.pipeline import EmptyTextError
from app.server.errors import ApiError
from app.server.openai_api import V1_PARAMS
from app.server.speech import map_error
from app.server.studio_stream import STUDIO_PARAMS
from app.service.admission import BusyError
from app.service.fair_share import ShareError
from app.service.inputs import InputError
from app.service.refusals import ENGINE_RETRY_AFTER_S, RETRY_AFTER_S, refusal
from app.service.service import OOM_ADVICE, EngineDeadError, GpuOutOfMemoryError, NotReadyError
from app.service.voice_file import VoiceFileError
from app.service.voices import VoiceError
from app.ui.handlers import page_error

CASES = [  # raised, (status, code, title, Retry-After s, prepare's field)
    (InputError("the reference clip is 31 s long; at most 30 s", param="reference", code="reference_too_long"),
     (400, "reference_too_long", "Error", None, "reference")),
    (EmptyTextError("Type the text to speak."), (400, "empty_text", "Error", None, "text")),
    (ShareError("you already have 2 syntheses running"), (429, "client_share_exceeded", "Your share is in use",
                                                          ShareError.retry_after_s, None)),
    (BusyError("the server is busy"), (503, "server_busy", "Busy", RETRY_AFTER_S, None)),
    (EngineDeadError("the speech engine died; restarting"), (503, "engine_dead", "Not ready", ENGINE_RETRY_AFTER_S,
                                                            None)),
    (NotReadyError("the model is loading"), (503, "not_ready", "Not ready", RETRY_AFTER_S, None)),
    (GpuOutOfMemoryError(OOM_ADVICE), (503, "gpu_out_of_memory", "Error", RETRY_AFTER_S, None)),
    (ValueError("the prompt plus the output exceed max_model_len 2048"), (400, "invalid_request", "Error", None, None)),
]


@pytest.mark.parametrize("error, want", CASES, ids=[type(e).__name__ for e, _ in CASES])
def test_every_door_reads_a_refusal_the_same(error, want, caplog):
    status, code, title, retry_s, param = want
    r = refusal(error)
    assert (r.status, r.code, r.title, r.retry_after_s, r.param) == want
    assert str(error) in r.message
    # the HTTP doors: the same status, code and message; the field in each door's own name
    for params in (V1_PARAMS, STUDIO_PARAMS):
        api = map_error(error, params)
        assert (api.status, api.code, api.message) == (status, code, r.message)
        assert api.param == (None if param is None else params.get(param, param))
        assert api.headers.get("Retry-After") == (None if retry_s is None else f"{retry_s:g}")
    # the page: the same message under the refusal's title, no traceback; a refused input logs one line
    with caplog.at_level(logging.INFO, logger="app.ui.handlers"):
        page = page_error(error)
    assert isinstance(page, gr.Error) and page.message == r.message and page.title == title
    assert not page.print_exception
    assert [rec.getMessage() for rec in caplog.records] == ([f"refused input: {r.message}"] if status == 400 else [])


def test_the_openai_door_names_its_own_fields():
    assert map_error(EmptyTextError("Type the text to speak."), V1_PARAMS).param == "input"
    assert map_error(InputError("no such voice", param="reference", code="voice_not_found"), V1_PARAMS).param == "voice"


def test_a_bug_is_no_refusal_and_propagates_from_every_door():
    bug = KeyError("lm_head")
    assert refusal(bug) is None
    with pytest.raises(KeyError):
        map_error(bug)
    with pytest.raises(KeyError):
        page_error(bug)


VOICE_CASES = [  # the voice door's refusals (app/service/voice_door.py): raised, (status, code, title, field)
    (VoiceError("a voice named 'fox' exists already; delete it first or choose another name", code="exists"),
     (409, "voice_exists", "Name taken", "name")),
    (VoiceError("no saved voice named 'fox'", code="not_found"), (404, "voice_not_found", "Error", "voice")),
    (VoiceError("voice 'fox' is damaged; delete it and save it again", code="damaged"),
     (409, "voice_unusable", "Error", "voice")),
    (VoiceError("invalid voice name '../x'", code="invalid_name"), (400, "invalid_value", "Error", "name")),
    (VoiceFileError("the voice file was made with another model", code="other_model"),
     (400, "other_model", "Error", "file")),
    (VoiceFileError("the voice file is larger than 1 MB", code="file_too_large"),
     (413, "file_too_large", "Error", "file")),
]


@pytest.mark.parametrize("error, want", VOICE_CASES, ids=[c for _, (_, c, _, _) in VOICE_CASES])
def test_the_voice_doors_read_the_same_table(error, want):
    from app.server.voices_api import VOICE_PARAMS, refused

    r = refusal(error)
    assert (r.status, r.code, r.title, r.param) == want and r.message == str(error)
    with pytest.raises(ApiError) as api, refused():  # the /v1 voice routes
        raise error
    assert (api.value.status, api.value.code, api.value.param) == (r.status, r.code, VOICE_PARAMS.get(r.param, r.param))
    page = page_error(error)  # the page: the same message under the same title; a taken name says how to replace it
    assert page.title == r.title and page.message.startswith(r.message)
    assert ("overwrite=True" in page.message) == ("overwrite=true" in api.value.message) == (r.code == "voice_exists")
