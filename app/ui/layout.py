"""The studio page: inputs, outputs, examples, live panels, and the wiring (handlers live in handlers.py).

`build_demo(service)` declares the `gr.Blocks` and its events; `app.py` mounts it on FastAPI.
Public API events: `synthesize` (see `Handlers.synthesize`), `save_voice`, `delete_voice`, `list_voices`.

Generate first runs a browser-only gate (player.GATE_JS): with the low-latency player (default) the
request is played by WebAudio from /studio/speech (player.js) and the gate stops the chain; with the
standard player (or streaming off) it passes on to `synthesize`, Gradio's streamed gr.Audio (also the
fallback where the page's player cannot start). After a low-latency stream the page itself shows the
final WAV (built from the PCM it played), the stats line and details (GET /studio/requests/{id}) in
the player's result area, in place of `final_out`, `stats` and `details` (app/ui/player.py).
"""

from __future__ import annotations

import json

import gradio as gr

from app.engine.service import ASSETS_DIR, StudioService
from app.ui.handlers import Handlers
from app.ui.i18n import make_i18n
from app.ui.panels import PANEL_TRANSLATIONS, build_panels
from app.ui.player import GATE_JS, PLAYER_HTML, STOP_JS, player_js

CACHE_CLEANUP = (3600, 3600)  # every hour, delete outputs older than an hour from Gradio's cache
# the page asks before deleting a saved voice (a refusal throws, which ends the event); API clients are not asked
CONFIRM_DELETE_JS = """(voice) => {
  if (voice && !window.confirm('Delete the saved voice "' + voice + '"? This cannot be undone.')) {
    throw new Error('deletion cancelled');
  }
  return [voice];
}"""


def example_rows() -> tuple[list[list], list[str]]:
    """Rows (text, prompt_audio, prompt_text, mode, instruct_text) built from assets/examples.json."""
    spec = json.loads((ASSETS_DIR / "examples.json").read_text(encoding="utf-8"))
    voices = {v["name"]: v for v in spec["voices"]}
    texts = {t["lang"]: t["text"] for t in reversed(spec["texts"])}  # the first text of each language
    numbers = spec["texts"][-1]["text"]
    en, zh = voices["espeak-en"], voices["espeak-zh"]
    rows = [
        (texts["en"], en, "zero_shot", "", "English, zero-shot"),
        (texts["zh"], zh, "zero_shot", "", "中文, zero-shot"),
        (numbers, en, "zero_shot", "", "numbers and dates"),
        (texts["zh"], en, "cross_lingual", "", "English voice speaks Chinese"),
        (texts["en"], zh, "instruct", "Speak slowly and calmly.", "instruct"),
    ]
    out = [[text, str(ASSETS_DIR / v["audio"]), v["transcript"] if mode == "zero_shot" else "", mode, instruct]
           for text, v, mode, instruct, _ in rows]
    return out, [label for *_, label in rows]


def build_demo(service: StudioService) -> tuple[gr.Blocks, gr.I18n]:
    """The page and its translations (pass both to `gr.mount_gradio_app`)."""
    cfg = service.cfg
    i18n = make_i18n(PANEL_TRANSLATIONS)
    h = Handlers(service)
    with gr.Blocks(title=cfg.ui.title, delete_cache=CACHE_CLEANUP) as demo:
        gr.Markdown(f"# {cfg.ui.title}")
        gr.Markdown(i18n("intro"))
        banner = gr.Markdown(visible=False, elem_id="banner")
        status = gr.Markdown("**Status:** starting…", elem_id="status")
        with gr.Row():
            with gr.Column():
                text = gr.Textbox(label=i18n("text"), placeholder=i18n("text_placeholder"), lines=4,
                                  max_length=cfg.limits.max_text_chars, elem_id="text")
                with gr.Group():
                    prompt_audio = gr.Audio(sources=["upload", "microphone"], type="filepath",
                                            label=i18n("prompt_audio"), elem_id="prompt_audio")
                    prompt_text = gr.Textbox(label=i18n("prompt_text"), info=i18n("prompt_text_info"),
                                             elem_id="prompt_text")
                gr.Markdown(i18n("consent"), elem_id="consent")
                mode = gr.Radio([(i18n("mode_zero_shot"), "zero_shot"), (i18n("mode_cross_lingual"), "cross_lingual"),
                                 (i18n("mode_instruct"), "instruct")], value="zero_shot", label=i18n("mode"),
                                elem_id="mode")
                instruct_text = gr.Textbox(label=i18n("instruct_text"), placeholder=i18n("instruct_placeholder"),
                                           visible=False, elem_id="instruct_text")
                with gr.Accordion(i18n("saved_voices"), open=False):
                    voice = gr.Dropdown([""], value="", allow_custom_value=True, label=i18n("voice"),
                                        elem_id="voice")
                    with gr.Row():
                        voice_name = gr.Textbox(label=i18n("voice_name"), max_length=64, elem_id="voice_name")
                        replace_voice = gr.Checkbox(False, label=i18n("replace_voice"), elem_id="replace_voice")
                        save = gr.Button(i18n("save_voice"), elem_id="save_voice")
                        delete = gr.Button(i18n("delete_voice"), elem_id="delete_voice")
                    voice_msg = gr.Markdown(elem_id="voice_msg")
                with gr.Row():
                    seed = gr.Number(0, precision=0, minimum=-1, label=i18n("seed"), elem_id="seed")
                    dice = gr.Button(i18n("random_seed"), elem_id="dice")
                with gr.Row():
                    stream = gr.Checkbox(True, label=i18n("stream"), elem_id="stream")
                    speed = gr.Slider(0.5, 2.0, value=1.0, step=0.05, label=i18n("speed"), interactive=False,
                                      elem_id="speed")
                player = gr.Radio([(i18n("player_webaudio"), "webaudio"), (i18n("player_gradio"), "gradio")],
                                  value="webaudio", label=i18n("player"), info=i18n("player_info"), elem_id="player")
                with gr.Row():
                    go = gr.Button(i18n("generate"), variant="primary", elem_id="go")
                    stop = gr.Button(i18n("stop"), variant="stop", elem_id="stop")
            with gr.Column():
                stream_out = gr.Audio(streaming=True, autoplay=True, label=i18n("stream_out"), elem_id="stream_out")
                # the low-latency player's line and result area (player.js fills it)
                gr.HTML(PLAYER_HTML, elem_id="player_box", js_on_load=None)
                final_out = gr.Audio(type="filepath", interactive=False, label=i18n("final_out"),
                                     buttons=["download"], elem_id="final_out")
                stats = gr.Markdown(elem_id="stats")
                with gr.Accordion(i18n("details"), open=False, elem_id="details_box"):
                    details = gr.JSON(elem_id="details")
        rows, labels = example_rows()
        gr.Examples(rows, [text, prompt_audio, prompt_text, mode, instruct_text], cache_examples=False,
                    example_labels=labels, label=i18n("examples"))
        with gr.Accordion(i18n("panels"), open=True):
            build_panels(service, i18n)

        inputs = [text, prompt_audio, prompt_text, mode, instruct_text, voice, seed, speed, stream]
        outputs = [stream_out, final_out, stats, details]
        gate = go.click(None, [text, prompt_audio, prompt_text, mode, instruct_text, voice, seed, stream, player],
                        None, js=GATE_JS, queue=False, api_visibility="private")
        synth = gate.success(h.synthesize, inputs, outputs, api_name="synthesize",
                             concurrency_limit=cfg.server.concurrency_limit, concurrency_id="synthesize")
        stop.click(None, None, None, cancels=[synth], api_visibility="private")
        stop.click(None, None, None, js=STOP_JS, queue=False, api_visibility="private")
        dice.click(h.random_seed, None, seed, queue=False, api_visibility="private")
        stream.change(lambda on: gr.Slider(interactive=not on, value=1.0), stream, speed, queue=False,
                      api_visibility="private")
        mode.change(lambda m: gr.Textbox(visible=m == "instruct"), mode, instruct_text, queue=False,
                    api_visibility="private")
        save.click(h.save_voice, [voice_name, prompt_audio, prompt_text, replace_voice], [voice_msg, voice],
                   api_name="save_voice",
                   ).then(h.voice_choices, voice, voice, queue=False, api_visibility="private")
        delete.click(h.delete_voice, voice, [voice_msg, voice], api_name="delete_voice", js=CONFIRM_DELETE_JS,
                     ).then(h.voice_choices, voice, voice, queue=False, api_visibility="private")
        gr.api(h.list_voices, api_name="list_voices")
        timer = gr.Timer(cfg.ui.status_refresh_s)
        timer.tick(h.status, None, [status, banner, timer], queue=False, show_progress="hidden",
                   api_visibility="private")
        demo.load(h.status, None, [status, banner, timer], queue=False, api_visibility="private")
        demo.load(None, None, None, js=player_js(), api_visibility="private")  # defines window.studioPlayer
        demo.load(h.voice_choices, voice, voice, queue=False, api_visibility="private")
    demo.queue(max_size=cfg.server.queue_max_size)
    return demo, i18n
