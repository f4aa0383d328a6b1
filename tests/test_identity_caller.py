"""One Caller per request (app/server/identity.py): what the HTTP doors and the page's events read."""

from __future__ import annotations

from app.config import load_config
from app.engine.owners import NOBODY, Caller, Owner
from app.server.identity import CALLER_KEY, Identity, caller_of, page_caller


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
    assert page_caller(scope, None, None) is found
    assert page_caller(scope, "alice", "bob") == Caller(Owner("hf:alice"), "hf:alice", False)
    assert page_caller(scope, None, "bob") == Caller(Owner("user:bob"), "ip:203.0.113.7", False)
    # a session cookie means nothing without Hugging Face sign-in on this app (no OAUTH_CLIENT_ID)
    again, _ = ident.identify(_scope("203.0.113.7", (b"cookie", b"session=forged")), None)
    assert again.owner.id.startswith("visitor:")
