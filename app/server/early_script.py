"""A script the page runs before Gradio's own code (app/ui/early_script.js), put into its HTML by the
`EarlyScript` middleware (docs/design.md)."""

from __future__ import annotations

from typing import Any

from app.ui import ui_text


class EarlyScript:
    """ASGI middleware: Gradio's page (a GET whose HTML holds `gradio_config`) gets the script first in `<head>`."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.tag = f"<script>{ui_text('early_script.js')}</script>".encode()

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
                html = html.replace(b"<head>", b"<head>" + self.tag, 1)
            headers = [(k, v) for k, v in start["headers"] if k != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(html)).encode())]})
            await send({"type": "http.response.body", "body": html})

        await self.app(scope, receive, send_page)
