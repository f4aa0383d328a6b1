"""One Caller per request (app/server/identity.py): what the HTTP doors and the page's events read."""

from __future__ import annotations

import time
import warnings
from types import SimpleNamespace

import fastapi
import gradio.oauth
from starlette.requests import Request
from starlette.testclient import TestClient

from app.config import load_config
from app.server.identity import SESSION_COOKIE, Identity, caller_of, session_user
from app.service.owners import CALLER_KEY, NOBODY, Caller, Owner
from app.ui.handlers import caller as page_caller_of


def _identity(tmp_path, **sets) -> Identity:
    return Identity(load_config(None, {"server.voices_dir": str(tmp_path / "v"), "voices.scope": "private",
                                       **{f"server.{k}": v for k, v in sets.items()}}))


def _scope(ip: str, *headers: tuple[bytes, bytes]) -> dict:
    return {"type": "http", "client": (ip, 50000), "headers": list(headers)}


def test_one_caller_goes_into_the_request_state(tmp_path):
    ident = _identity(tmp_path, api_keys="alice:ka", admin_key="root")
    scope = _scope("203.0.113.5", (b"authorization", b"Bearer ka"))
    caller, set_cookie = ident.identify(scope, None)
    assert caller == Caller(Owner("key:alice"), "key:alice", False) and set_cookie is None
    assert scope["state"][CALLER_KEY] is caller and caller_of(scope) is caller
    admin, _ = ident.identify(_scope("203.0.113.5", (b"authorization", b"Bearer root")), None)
    assert admin.owner.admin and admin.admin
    visitor, set_cookie = ident.identify(stranger := _scope("203.0.113.6"), None)  # a new browser: a cookie
    assert visitor.owner.id.startswith("visitor:") and visitor.client == "ip:203.0.113.6" and not visitor.admin
    assert set_cookie and caller_of(stranger) is visitor
    local, _ = ident.identify(_scope("127.0.0.1"), "bob")  # a login user on this machine: an admin
    assert local == Caller(Owner("user:bob"), "ip:127.0.0.1", True)
    assert caller_of({}) is NOBODY  # no gate ran (tools, tests)


def test_a_page_event_prefers_the_signed_in_user_then_the_login(tmp_path):
    ident = _identity(tmp_path)
    scope = _scope("203.0.113.7")
    found, _ = ident.identify(scope, None)

    def event(login_user: str | None) -> SimpleNamespace:  # a gr.Request: its Starlette request and login user
        return SimpleNamespace(request=Request(scope), username=login_user)

    alice = SimpleNamespace(username="alice")  # a gr.OAuthProfile
    assert page_caller_of(event(None)) is found and page_caller_of(None) is NOBODY
    assert page_caller_of(event("bob"), alice) == Caller(Owner("hf:alice"), "hf:alice", False)
    assert page_caller_of(event("bob")) == Caller(Owner("user:bob"), "ip:203.0.113.7", False)
    # a session cookie means nothing without Hugging Face sign-in on this app (no OAUTH_CLIENT_ID)
    again, _ = ident.identify(_scope("203.0.113.7", (b"cookie", b"session=forged")), None)
    assert again.owner.id.startswith("visitor:")


def _gradio_sign_in(monkeypatch, client_secret: str, user: str) -> TestClient:
    """Gradio's own OAuth app (gradio/oauth.py `attach_oauth`: its SessionMiddleware, key recipe and
    sign-in routes) off a Space, where its callback stores the profile of this machine's HF token; only
    the Hub's answer for that token is made up. Returns a client whose jar holds the signed session."""
    monkeypatch.delenv("SYSTEM", raising=False)  # not a Space: Gradio's local sign-in, no authlib
    monkeypatch.setattr(gradio.oauth, "OAUTH_CLIENT_SECRET", client_secret)  # read once at its import
    monkeypatch.setattr(gradio.oauth, "get_token", lambda: "hf_test")
    monkeypatch.setattr(gradio.oauth, "whoami", lambda: {"type": "user", "name": user, "fullname": user.title(),
                                                         "avatarUrl": ""})
    app = fastapi.FastAPI()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "OAuth features outside of a Space ... mocked"
        gradio.oauth.attach_oauth(app)
    client = TestClient(app, base_url="https://testserver")  # the cookie is Secure: HTTPS only
    assert client.get("/login/callback", follow_redirects=False).is_redirect
    return client


def _session_scope(value: str) -> dict:
    return _scope("203.0.113.8", (b"cookie", f"other=1; {SESSION_COOKIE}={value}".encode()))


def test_gradio_oauth_session_names_the_signed_in_user(tmp_path, monkeypatch):
    """session_user reads the cookie Gradio's OAuth writes: a Gradio upgrade that changes its key recipe,
    cookie name or session layout fails here (docs/limits.md)."""
    monkeypatch.setenv("OAUTH_CLIENT_ID", "client-id")
    monkeypatch.setenv("OAUTH_CLIENT_SECRET", "space-secret")
    signed = _gradio_sign_in(monkeypatch, "space-secret", "alice").cookies.get(SESSION_COOKIE)
    assert signed, f"Gradio's OAuth set no {SESSION_COOKIE!r} cookie"
    assert session_user(_session_scope(signed)) == "alice"
    caller, _ = _identity(tmp_path).identify(_session_scope(signed), None)  # what /studio/speech sees
    assert caller.owner == Owner("hf:alice") and caller.client == "ip:203.0.113.8"

    payload, _, signature = signed.rpartition(".")  # payload: base64 JSON "." timestamp
    flipped = "A" if payload[5] != "A" else "B"
    assert session_user(_session_scope(payload[:5] + flipped + payload[6:] + "." + signature)) is None
    foreign = _gradio_sign_in(monkeypatch, "another-space", "mallory").cookies.get(SESSION_COOKIE)
    assert foreign and session_user(_session_scope(foreign)) is None  # another Space's (or key's) session
    assert session_user(_session_scope("garbage")) is None
    # a sign-in whose token expired (Gradio's `expires_at`, 8 h after its callback ran 9 h ago)
    monkeypatch.setattr(gradio.oauth, "time", SimpleNamespace(time=lambda: time.time() - 9 * 3600))
    stale = _gradio_sign_in(monkeypatch, "space-secret", "alice").cookies.get(SESSION_COOKIE)
    assert stale and session_user(_session_scope(stale)) is None
    monkeypatch.delenv("OAUTH_CLIENT_ID")
    assert session_user(_session_scope(signed)) is None  # no Hugging Face sign-in on this app: ignored
