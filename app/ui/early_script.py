"""A script the page runs before Gradio's own code, put into its HTML by the `EarlyScript` middleware.

It ends a loop Gradio 6.31 leaves running in every open tab. While the app starts, its loader shows a
StatusTracker whose elapsed-time counter runs on requestAnimationFrame; the loader is unmounted while
its status is still "pending", so that counter never stops: 60 frames a second for as long as the tab
is open, ~7 % of a core in headless Chromium on an idle page (bench/ux_measure.py). Gradio keeps its
own reference to requestAnimationFrame from when its modules load, so the wrapper (early_script.js) has
to be in place before them: a `<script>` first in `<head>`, which only a middleware can write (Gradio's
`head=` runs after its modules). The wrapper knows the counter by its callback's code (minified: stable
for the pinned Gradio); a counter loop begun before the page's own load event ran (`APP_LOADED_JS`, wired
in layout.py: the app is mounted, the loader gone) is the loader's, and its next frame is dropped, which
ends it. Every other callback passes untouched.
"""

from __future__ import annotations

import functools
from typing import Any

from app.ui import ui_text

APP_LOADED_JS = "() => { if (window.studioAppLoaded) window.studioAppLoaded(); }"  # a demo.load (layout.py)


@functools.cache
def early_tag() -> bytes:
    """The `<script>` of early_script.js, read once."""
    return f"<script>{ui_text('early_script.js')}</script>".encode()


class EarlyScript:
    """ASGI middleware: Gradio's page (a GET whose HTML holds `gradio_config`) gets `early_tag()` first in `<head>`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "GET":
            await self.app(scope, receive, send)
            return
        start: dict | None = None  # an HTML response's start, held until its body is complete
        body = bytearray()

        async def send_page(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                if headers.get(b"content-type", b"").startswith(b"text/html") and b"content-encoding" not in headers:
                    start = message
                    return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            body.extend(message.get("body", b""))
            if message.get("more_body"):
                return
            html = bytes(body)
            if b"gradio_config" in html:
                html = html.replace(b"<head>", b"<head>" + early_tag(), 1)
            headers = [(k, v) for k, v in start["headers"] if k != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(html)).encode())]})
            await send({"type": "http.response.body", "body": html})

        await self.app(scope, receive, send_page)
