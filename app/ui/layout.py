"""The studio page: inputs, outputs, examples, live panels, and the wiring (handlers live in handlers.py).
Design notes: docs/design.md."""

from __future__ import annotations

import json
import os
import secrets
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gradio as gr

from app.config import Config
from app.service.inputs import MAX_SEED
from app.service.service import ASSETS_DIR, StudioService
from app.service.voice_file import SUFFIX
from app.ui import hidden_element, history, panels, ui_text
from app.ui.download import build_download
from app.ui.handlers import NO_VOICE, Handlers
from app.ui.i18n import EXAMPLE_KEYS, example_label, make_i18n
from app.ui.player import FINAL_JS, SEED_BOX_JS, SEED_JS, STATUS_HTML, TYPED_JS, PlayerTake, player_js
from app.ui.presets import apply_preset, preset_choices

PAGE_ONLY = {"queue": False, "api_visibility": "private"}  # the page's own events: no queue, not in the API
# API values typed as any string, by their label's key: the saved voice is any name (its choices change at run time)
ANY_NAME = {"voice": "a saved voice's name (see /list_voices), or '' for none"}


class StudioBlocks(gr.Blocks):
    """gr.Blocks whose API page ("Use via API") names parameters by their English labels (Gradio lists
    translated labels there as "[object Object]", and a `gr.api` endpoint's as ordinals) and types `ANY_NAME`'s
    as any string."""

    def __init__(self, *args: Any, english: dict[str, str] | None = None, **kwargs: Any) -> None:
        self.english = english or {}  # translation key -> English label
        super().__init__(*args, **kwargs)

    def get_api_info(self, all_endpoints: bool = False, page: str | None = None) -> Any:
        info = super().get_api_info(all_endpoints=all_endpoints, page=page)
        for endpoint in [*info["named_endpoints"].values(), *info["unnamed_endpoints"].values()]:
            for item in [*endpoint["parameters"], *endpoint["returns"]]:
                label = item.get("label")  # a gr.I18nData (or its dict form)
                key = label.get("key") if isinstance(label, dict) else getattr(label, "key", None)
                if key is None and item.get("component") == "Api":  # gr.api's: "1st", ...; its name is a label key
                    key = item.get("parameter_name")
                if isinstance(key, str):
                    item["label"] = self.english.get(key, key)
                if key in ANY_NAME:  # Gradio's type: a Literal of the dropdown's choices at build time
                    item["type"] = {"type": "string", "description": ANY_NAME[key]}
                    item["python_type"] = {"type": "str", "description": ANY_NAME[key]}
        return info


def example_path(name: str) -> str:
    """An example clip's path as the page gets it (in its file URL, and back in each request): relative to the
    working folder (the app's, as `python app.py` runs), so no visitor learns where the app is installed."""
    path = ASSETS_DIR / name
    relative = os.path.relpath(path)
    return path.as_posix() if relative.startswith("..") else Path(relative).as_posix()


def example_rows() -> list[list]:
    """Rows (text, prompt_audio, prompt_text, mode, instruct_text) from assets/examples.json, labelled by
    EXAMPLE_KEYS (app/ui/locales/labels.toml) in this order."""
    spec = json.loads((ASSETS_DIR / "examples.json").read_text(encoding="utf-8"))
    voices = {v["name"]: v for v in spec["voices"]}
    texts = {t["lang"]: t["text"] for t in reversed(spec["texts"])}  # the first text of each language
    numbers = spec["texts"][-1]["text"]
    en, zh = voices["espeak-en"], voices["espeak-zh"]

    def row(text: str, voice: dict, mode: str = "zero_shot", instruct: str = "") -> list:
        return [text, example_path(voice["audio"]), voice["transcript"] if mode == "zero_shot" else "", mode,
                instruct]

    return [row(texts["en"], en), row(texts["zh"], zh), row(numbers, en), row(texts["zh"], en, "cross_lingual"),
            row(texts["en"], zh, "instruct", "Speak slowly and calmly.")]


def build_demo(service: StudioService) -> tuple[gr.Blocks, gr.I18n]:
    """The page and its translations (pass both to `gr.mount_gradio_app`)."""
    cfg = service.cfg
    i18n = make_i18n(panels.catalog()["labels"])
    h = Handlers(service)
    ui = SimpleNamespace()  # the page's components by name, filled section by section, then wired
    # the sections run in page order, then the events: Gradio numbers components and events as they are made
    # the examples' clips are served from assets/ as they are, never copied into Gradio's cache folder, where
    # the hourly cleanup or another instance's shutdown (same temp folder) would delete them from under the page
    gr.set_static_paths([ASSETS_DIR])
    cleanup = (cfg.ui.cache_cleanup_s, cfg.ui.cache_cleanup_s)  # (how often, older than): outputs and uploads
    with StudioBlocks(title=cfg.ui.title, delete_cache=cleanup, english=i18n.translations.get("en")) as demo:
        header(ui, cfg, i18n)
        with gr.Row():
            inputs_column(ui, i18n)
            outputs_column(ui, i18n)
        examples_and_panels(ui, service, i18n)
        wire_synthesis(ui, h, cfg)
        wire_voices(ui, h)
        wire_controls(ui, h)
        wire_page(demo, ui, h, cfg)
    demo.queue(max_size=cfg.server.queue_max_size)
    return demo, i18n


def header(ui: SimpleNamespace, cfg: Config, i18n: gr.I18n) -> None:
    with gr.Row(equal_height=True):
        gr.Markdown(f"# {cfg.ui.title}")
        # a Space with `hf_oauth: true` in its README (Spaces then set OAUTH_CLIENT_ID): Hugging Face sign-in, voices
        # are the signed-in user's (app/service/owners.py). Nowhere else: off a Space, Gradio's LoginButton logs in
        # with this machine's token
        if os.environ.get("SPACE_ID") and os.environ.get("OAUTH_CLIENT_ID"):
            gr.LoginButton(scale=0, min_width=160, elem_id="login")
    gr.Markdown(i18n("intro"))
    ui.banner = gr.Markdown(visible=False, elem_id="banner")
    ui.status = gr.Markdown("**Status:** starting…", elem_id="status")


def inputs_column(ui: SimpleNamespace, i18n: gr.I18n) -> None:
    with gr.Column():
        # no max_length: a browser cuts a longer paste silently (mid-word); the server refuses it naming the limit
        ui.text = gr.Textbox(label=i18n("text"), placeholder=i18n("text_placeholder"), lines=4, elem_id="text")
        gr.Markdown(i18n("tags_help"), elem_id="tags_help")
        ui.dialogue = gr.Checkbox(False, label=i18n("dialogue"), info=i18n("dialogue_info"), elem_id="dialogue")
        with gr.Group():
            ui.prompt_audio = gr.Audio(sources=["upload", "microphone"], type="filepath",
                                       label=i18n("prompt_audio"), elem_id="prompt_audio")
            ui.prompt_text = gr.Textbox(label=i18n("prompt_text"), info=i18n("prompt_text_info"),
                                        elem_id="prompt_text")
            ui.transcribe = gr.Button(i18n("transcribe"), size="sm", elem_id="transcribe")
        gr.Markdown(i18n("consent"), elem_id="consent")
        ui.mode = gr.Radio([(i18n("mode_zero_shot"), "zero_shot"), (i18n("mode_cross_lingual"), "cross_lingual"),
                            (i18n("mode_instruct"), "instruct")], value="zero_shot", label=i18n("mode"),
                           elem_id="mode")
        ui.instruct_text = gr.Textbox(label=i18n("instruct_text"), placeholder=i18n("instruct_placeholder"),
                                      visible=False, elem_id="instruct_text")
        ui.preset = gr.Dropdown(preset_choices(), value="", label=i18n("preset"), info=i18n("preset_info"),
                                visible=False, elem_id="preset")
        saved_voice_box(ui, i18n)
        with gr.Row():
            ui.seed = gr.Number(0, precision=0, minimum=-1, label=i18n("seed"), elem_id="seed")
            ui.dice = gr.Button(i18n("random_seed"), elem_id="dice")
        # the seed the low-latency player's take used, into the box as the take starts (app/ui/player.py SEED_JS)
        seed_in = hidden_element("player_seed", SEED_JS)
        seed_in.change(None, seed_in, ui.seed, js=SEED_BOX_JS, **PAGE_ONLY)
        with gr.Row():
            ui.stream = gr.Checkbox(True, label=i18n("stream"), elem_id="stream")
            ui.speed = gr.Slider(0.5, 2.0, value=1.0, step=0.05, label=i18n("speed"), interactive=False,
                                 elem_id="speed")
        with gr.Row():  # text that streams in: the box's words go to the WebSocket door at this rate (player_feed.js)
            ui.text_streams = gr.Checkbox(False, label=i18n("text_streams"), info=i18n("text_streams_info"),
                                          elem_id="text_streams")
            ui.feed_rate = gr.Slider(1, 10, value=3, step=0.5, label=i18n("feed_rate"), elem_id="feed_rate")
        with gr.Row():
            ui.go = gr.Button(i18n("generate"), variant="primary", elem_id="go")
            ui.stop = gr.Button(i18n("stop"), variant="stop", elem_id="stop")
        # busy state and errors of both players, next to the buttons (player.js fills it)
        gr.HTML(STATUS_HTML, elem_id="studio_status_box")


def saved_voice_box(ui: SimpleNamespace, i18n: gr.I18n) -> None:
    with gr.Accordion(i18n("saved_voices"), open=False):
        ui.voice = gr.Dropdown([NO_VOICE], value="", allow_custom_value=True, label=i18n("voice"), elem_id="voice")
        with gr.Row():
            ui.voice_name = gr.Textbox(label=i18n("voice_name"), max_length=64, elem_id="voice_name")
            ui.replace_voice = gr.Checkbox(False, label=i18n("replace_voice"), elem_id="replace_voice")
            ui.save = gr.Button(i18n("save_voice"), elem_id="save_voice")
            ui.delete = gr.Button(i18n("delete_voice"), elem_id="delete_voice")
        with gr.Row(equal_height=True):  # a voice as a .cvvoice file: a backup, or for another server
            ui.export = gr.Button(i18n("export_voice"), elem_id="export_voice")
            ui.exported = gr.File(label=i18n("exported_voice"), interactive=False, elem_id="exported_voice")
        with gr.Row(equal_height=True):
            ui.import_file = gr.File(label=i18n("import_file"), file_types=[SUFFIX], type="filepath",
                                     elem_id="import_file")
            ui.import_ = gr.Button(i18n("import_voice"), elem_id="import_voice")
        ui.voice_msg = gr.Markdown(elem_id="voice_msg")


def outputs_column(ui: SimpleNamespace, i18n: gr.I18n) -> None:
    with gr.Column():
        # the low-latency player's line (click -> first byte -> first sound) and controls (pause, volume, played /
        # received seconds), player.html as one line (no whitespace between its elements); player.js fills them
        gr.HTML("".join(map(str.strip, ui_text("player.html").splitlines())), elem_id="player_box", js_on_load=None)
        ui.take = hidden_element("player_take", ui_text("player_take.js"))  # its takes come in through this
        ui.final_out = gr.Audio(type="filepath", interactive=False, label=i18n("final_out"),
                                buttons=["download"], elem_id="final_out")
        build_download(ui.final_out, i18n, **PAGE_ONLY)  # the take as mp3/opus/aac/flac (app/ui/download.py)
        ui.stats = gr.Markdown(elem_id="stats")
        with gr.Accordion(i18n("details"), open=False, elem_id="details_box"):
            ui.details = gr.JSON(elem_id="details")
        ui.history_use = history.history_box(i18n)  # the visitor's takes, kept in the browser (app/ui/history.py)


def examples_and_panels(ui: SimpleNamespace, service: StudioService, i18n: gr.I18n) -> None:
    ui.examples = gr.Examples(example_rows(), [ui.text, ui.prompt_audio, ui.prompt_text, ui.mode, ui.instruct_text],
                              cache_examples=False, example_labels=list(map(example_label, EXAMPLE_KEYS)),
                              label=i18n("examples"), elem_id="examples")
    with gr.Accordion(i18n("panels"), open=True) as panels_box:
        ui.panel_timer = panels.build_panels(service, i18n)
    # a collapsed panel costs nothing: its timer stops
    panels_box.collapse(lambda: gr.Timer(active=False), None, ui.panel_timer, **PAGE_ONLY)
    panels_box.expand(lambda: gr.Timer(active=True), None, ui.panel_timer, **PAGE_ONLY)


def wire_synthesis(ui: SimpleNamespace, h: Handlers, cfg: Config) -> None:
    """Generate plays through the page's player (player_gate.js: /studio/speech from the browser); its take comes
    back into the outputs through the take element. The Gradio API's `synthesize` is an endpoint of its own."""
    asked = [ui.text, ui.prompt_audio, ui.prompt_text, ui.mode, ui.instruct_text, ui.voice, ui.seed, ui.speed,
             ui.stream, ui.dialogue, ui.text_streams, ui.feed_rate]
    ui.go.click(None, asked, None, js=ui_text("player_gate.js"), **PAGE_ONLY)
    ui.text.change(None, ui.text, None, js=TYPED_JS, **PAGE_ONLY)  # for text that streams in
    gr.api(h.synthesize, api_name="synthesize", concurrency_limit=cfg.server.concurrency_limit,
           concurrency_id="synthesize")
    # the player's take (or "" at its Generate: cleared) into the outputs (app/ui/player.py): its final WAV from
    # the page's own Blob (in the browser), its stats line and details from the server
    ui.take.change(None, None, ui.final_out, js=FINAL_JS, **PAGE_ONLY)
    take = ui.take.change(PlayerTake(h.service).show, ui.take, [ui.stats, ui.details], show_progress="hidden",
                          **PAGE_ONLY)
    take.success(None, [ui.final_out, ui.details, ui.stats], None, js=history.RECORD_JS, **PAGE_ONLY)  # the history
    # "Use these settings": a take's settings into the inputs (the seed box keeps its value for a take without one)
    ui.history_use.change(None, [ui.history_use, ui.seed], [ui.text, ui.dialogue, ui.mode, ui.instruct_text, ui.seed,
                                                            ui.stream, ui.speed], js=history.SETTINGS_JS, **PAGE_ONLY)


def wire_voices(ui: SimpleNamespace, h: Handlers) -> None:
    """Save, Delete, Export, Import. A refused one (no reference clip, a taken name, no voice picked, ...) says why
    in Gradio's pop-up and clears the voice message (the previous action's). Their outputs show no progress: Gradio
    draws an "Error" badge over every output of a failed event, which would cover the saved-voice dropdown."""
    quiet = {"show_progress": "hidden"}
    save = ui.save.click(h.save_voice, [ui.voice_name, ui.prompt_audio, ui.prompt_text, ui.replace_voice],
                         [ui.voice_msg, ui.voice], api_name="save_voice", **quiet)
    delete = ui.delete.click(h.delete_voice, ui.voice, [ui.voice_msg, ui.voice], api_name="delete_voice",
                             js=ui_text("confirm_delete.js"), **quiet)
    gr.api(h.list_voices, api_name="list_voices")
    export = ui.export.click(h.export_voice, ui.voice, ui.exported, api_name="export_voice", **quiet)
    import_ = ui.import_.click(h.import_voice, [ui.import_file, ui.replace_voice],
                               [ui.voice_msg, ui.voice], api_name="import_voice", **quiet)
    for event in (save, delete, export, import_):
        event.failure(None, None, ui.voice_msg, js="() => ''", **PAGE_ONLY)
    for event in (save, delete, import_):
        event.then(h.voice_choices, ui.voice, ui.voice, **PAGE_ONLY)


def wire_controls(ui: SimpleNamespace, h: Handlers) -> None:
    """The reference check, the seed dice, the speed slider; transcription: the button, and a blank transcript
    filled beside Generate / Save; the instruct box and presets, shown in instruct mode."""
    # refused at once (queued: Gradio delivers gr.Warning pop-ups only to queued events)
    ui.prompt_audio.upload(h.check_upload, ui.prompt_audio, ui.prompt_audio, concurrency_id="upload_check",
                           concurrency_limit=2, show_progress="hidden", api_visibility="private")
    ui.dice.click(partial(secrets.randbelow, MAX_SEED + 1), None, ui.seed, api_name="random_seed", **PAGE_ONLY)
    # streaming speaks at speed 1 (the slider shows it); off again, the slider keeps what it was set to
    ui.stream.change(lambda on: gr.Slider(interactive=False, value=1.0) if on else gr.Slider(interactive=True),
                     ui.stream, ui.speed, **PAGE_ONLY)
    ui.transcribe.click(h.transcribe, ui.prompt_audio, ui.prompt_text, api_name="transcribe")
    ui.go.click(h.fill, [ui.prompt_audio, ui.prompt_text, ui.mode, ui.voice], ui.prompt_text, api_visibility="private")
    ui.save.click(h.fill, [ui.prompt_audio, ui.prompt_text], ui.prompt_text, api_visibility="private")
    ui.preset.input(apply_preset, [ui.preset, ui.instruct_text], ui.instruct_text, **PAGE_ONLY)
    ui.mode.change(lambda m: (gr.Textbox(visible=m == "instruct"), gr.Dropdown(visible=m == "instruct")), ui.mode,
                   [ui.instruct_text, ui.preset], **PAGE_ONLY)


def wire_page(demo: gr.Blocks, ui: SimpleNamespace, h: Handlers, cfg: Config) -> None:
    timer = gr.Timer(cfg.ui.status_refresh_s)
    status_out = [ui.status, ui.banner, timer]
    timer.tick(h.status, None, status_out, show_progress="hidden", **PAGE_ONLY)
    demo.load(h.status, None, status_out, **PAGE_ONLY)
    demo.load(None, None, None, js=player_js(), api_visibility="private")  # defines window.studioPlayer
    demo.load(h.voice_choices, ui.voice, ui.voice, **PAGE_ONLY)
    demo.load(None, None, None, js=history.history_js(), api_visibility="private")  # defines window.studioHistory
