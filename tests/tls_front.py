"""An https:// front for a test server (tests/test_agent_doors.py): the elevenlabs SDK's socket client always dials
wss://, and the studio under test speaks plain HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def tls_front(base: str, tmp_path) -> Iterator[str]:
    """An https:// front for `base` (a TLS-terminating TCP relay, its self-signed certificate trusted through
    SSL_CERT_FILE): the elevenlabs SDK's socket client always dials wss://."""
    import ssl
    import subprocess
    import threading

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    host, port = base.rsplit("//", 1)[1].split(":")
    loop, ready = asyncio.new_event_loop(), threading.Event()

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        w.close()

    async def relay(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        br, bw = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pipe(r, bw), pipe(br, w))

    def run() -> None:
        server = loop.run_until_complete(asyncio.start_server(relay, "127.0.0.1", 0, ssl=ctx))
        front.append(server.sockets[0].getsockname()[1])
        ready.set()
        loop.run_forever()

    front: list[int] = []
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(10)
    old = os.environ.get("SSL_CERT_FILE")
    os.environ["SSL_CERT_FILE"] = str(cert)
    try:
        yield f"https://127.0.0.1:{front[0]}"
    finally:
        os.environ.pop("SSL_CERT_FILE") if old is None else os.environ.__setitem__("SSL_CERT_FILE", old)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
