"""The final take's download in a chosen format: the final WAV, converted on the server to mp3, opus, aac or
flac with the API's encoders (app/audio_formats.py). The take's WAV lives in the page (a blob: URL): as WAV it is
that file; another format uploads it first (app/ui/player_take.js forServer)."""

from __future__ import annotations

from pathlib import Path

import gradio as gr
import numpy as np

from app.audio_formats import FORMATS, SUFFIXES, available, encode_whole

DOWNLOAD_FORMATS = tuple(f for f in FORMATS if f != "pcm")  # a raw PCM file is no use to a listener
# a format picked: the final WAV as the server gets it (the page's blob: take uploaded for another format, none for
# WAV) ...
TO_SERVER_JS = "async (final, fmt) => [window.studioTake ? await window.studioTake.forServer(final, fmt) : final, fmt]"
# ... whose button then offers the page's own file for WAV
PAGE_WAV_JS = ("(final, fmt, button) => [fmt === 'wav' && final && String(final.url).startsWith('blob:') ? final "
               ": button]")
# a new take (in the browser only): WAV again, the button offering the page's own file
NEW_TAKE_JS = "(final) => ['wav', final]"


def convert_take(path: str | None, fmt: str) -> str | None:
    """The final WAV at `path` as a `fmt` file beside it (the WAV itself for wav); None without a take."""
    if not path or fmt == "wav" or not available(fmt):
        return path or None
    import soundfile as sf

    samples, _ = sf.read(path, dtype="int16")  # [N] mono 24 kHz, as the page's player made it
    out = Path(path).with_suffix(SUFFIXES[fmt])
    out.write_bytes(encode_whole(np.ascontiguousarray(samples.reshape(-1)), fmt))
    return str(out)


def build_download(final_out: gr.Audio, i18n, **page_only) -> None:
    """A format choice and a download button under `final_out`: a new take is offered as WAV (the page's own
    file, no server call); a format the listener picks is converted on the server. Beside them the take's SRT and
    WebVTT links, once its words are aligned (player_words.js fills #download_subs)."""
    with gr.Row():
        fmt = gr.Dropdown([f for f in DOWNLOAD_FORMATS if available(f)], value="wav", label=i18n("download_format"),
                          elem_id="download_format", scale=1)
        button = gr.DownloadButton(i18n("download_take"), elem_id="download_take", scale=1)
        gr.HTML('<span id="download_subs"></span>', scale=1, js_on_load=None)  # SRT, WebVTT (player_words.js)
    final_out.change(None, final_out, [fmt, button], js=NEW_TAKE_JS, **page_only)
    fmt.input(convert_take, [final_out, fmt], button, js=TO_SERVER_JS, show_progress="hidden", **page_only).then(
        None, [final_out, fmt, button], button, js=PAGE_WAV_JS, **page_only)
