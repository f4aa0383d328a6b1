"""Safe in public: saved voices belong to whoever saved them, /health tells strangers nothing of the machine,
the schema states the configured limits, and one client's share leaves room for the others.

In-process (FastAPI TestClient, no engine) for the gate; an in-process service on the torch backend for the
signed-in Hugging Face user (the `gr.OAuthProfile` Gradio hands the page's handlers, passed as Gradio
passes it); `python app.py` (tiny model, real vLLM CPU engine) for visitors' cookies, the page through
`gradio_client`, raised limits and the fair share (conftest.py's studio_public), and one of its own for
API keys and the admin key.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import time
from pathlib import Path

import pytest
from studio import EXAMPLE_TRANSCRIPT, EXAMPLE_WAV
from test_app_api import _voice

from app.service.owners import ADMIN, OwnedVoices, Owner, owner_dir
from app.service.voices import VoiceError, VoiceStore

# --- the store -------------------------------------------------------------------------------------


def test_private_store_keeps_owners_apart_and_old_voices_go_to_the_admin(tmp_path):
    root = tmp_path / "voices"
    VoiceStore(root).save("old", _voice("saved before owners"), created=1.0)  # as saved before voices had owners
    voices = OwnedVoices(root, "private")
    alice, bob = Owner("visitor:a"), Owner("key:bob")
    voices.of(alice).save("fox", _voice("alice's"))
    voices.of(bob).save("fox", _voice("bob's"))  # the same name, another owner: no clash
    assert voices.of(alice).load("fox").prompt_text == "alice's" and voices.of(bob).load("fox").prompt_text == "bob's"
    assert [v.name for v in voices.visible(alice)] == ["fox"] and voices.visible(alice)[0].owner == "visitor:a"
    assert "old" not in voices.of(alice).names()  # an ownerless voice is nobody's but the admin's
    with pytest.raises(VoiceError, match="no saved voice"):
        voices.of(bob).load("old")
    everything = voices.visible(ADMIN)
    assert sorted((v.name, v.owner) for v in everything) == [("fox", "key:bob"), ("fox", "visitor:a"), ("old", "")]
    voices.of(ADMIN, "visitor:a").delete("fox")  # the admin may name another owner's voice
    assert voices.of(alice).names() == [] and voices.of(bob).names() == ["fox"]
    assert (root / owner_dir("key:bob") / "fox.safetensors").is_file()
    shared = OwnedVoices(root, "shared")  # today's behaviour: one store, the owner only recorded
    shared.of(alice).save("hare", _voice())
    assert set(shared.of(bob).names()) == {"hare", "old"} and shared.of(bob).info("hare").owner == "visitor:a"


def test_configured_transcript_limit_reaches_the_store(tmp_path):
    voices = OwnedVoices(tmp_path, "shared", max_transcript_chars=1200)
    voices.of(Owner("x")).save("long", _voice("a" * 1100))  # over the default 1000, under the configured 1200
    with pytest.raises(VoiceError, match="longer than 1200"):
        voices.of(Owner("x")).save("longer", _voice("a" * 1201))


def test_random_weights_are_marked(tiny_model_dir, tmp_path):
    from app.model.source import RANDOM_MARKER, is_random

    assert is_random(tiny_model_dir) and (tiny_model_dir / RANDOM_MARKER).is_file()
    assert not is_random(tmp_path)  # a folder without the mark (as every official one)


# --- the gate, in-process ------------------------------------------------------------------------------


@pytest.fixture()
def gated(tmp_path):
    from fastapi.testclient import TestClient

    from app.config import load_config
    from app.server.main import build_server

    cfg = load_config(None, {"server.api_keys": "alice:ka,bob:kb", "server.admin_key": "adm",
                             "server.metrics_token": "scrape", "server.voices_dir": str(tmp_path / "v"),
                             "model.dir": str(tmp_path / "models" / "secret-folder"), "voices.scope": "private",
                             "limits.max_text_chars": 2400, "limits.max_transcript_chars": 1200,
                             "limits.max_instruct_chars": 600, "limits.max_fixed_tokens": 1700})
    app = build_server(cfg)  # lifespan not run: never ready
    return cfg, (lambda ip: TestClient(app, raise_server_exceptions=False, client=(ip, 50000)))


def test_health_holds_no_path_for_a_stranger(gated):
    _, client = gated
    stranger = client("203.0.113.9")
    body = stranger.get("/health").json()
    assert set(body) == {"ready", "backend", "model", "random_model", "version", "voices"}, body
    assert body["voices"] == "private"  # keys are configured: each owner their own
    assert body["model"] == "secret-folder" and "/" not in json.dumps(body)
    proxied = client("127.0.0.1").get("/health", headers={"X-Forwarded-For": "203.0.113.9"}).json()
    assert "facts" not in proxied  # a forwarded request is never a local one
    assert "facts" in client("127.0.0.1").get("/health").json()  # the machine's own operator
    details = stranger.get("/health", headers={"Authorization": "Bearer adm"}).json()
    assert {"facts", "requests", "status"} <= set(details)  # the admin key
    assert set(body) <= set(details) and details["voices"] == "private"  # the public view and more
    assert "facts" not in stranger.get("/health", headers={"Authorization": "Bearer ka"}).json()  # any other key


def test_schema_limits_are_the_configured_ones_and_metrics_follow_the_keys(gated):
    cfg, client = gated
    c = client("203.0.113.9")
    assert c.get("/v1/openapi.json").status_code == 401 and c.get("/v1/docs").status_code == 401
    schema = c.get("/v1/openapi.json", headers={"Authorization": "Bearer kb"}).json()["components"]["schemas"]
    speech = schema["SpeechRequest"]["properties"]
    lim = cfg.limits
    assert speech["input"]["maxLength"] == lim.max_text_chars == 2400
    assert speech["instructions"]["maxLength"] == lim.max_instruct_chars
    assert speech["fixed_tokens"]["maximum"] == lim.max_fixed_tokens
    (form,) = [v for v in schema.values() if "transcript" in v.get("properties", {})]
    assert form["properties"]["transcript"]["maxLength"] == lim.max_transcript_chars
    assert c.get("/metrics").status_code == 401
    for token in ("scrape", "ka", "adm"):
        assert c.get("/metrics", headers={"Authorization": f"Bearer {token}"}).status_code == 200, token


def test_visitor_cookie_is_signed_and_http_only(gated):
    _, client = gated
    c = client("203.0.113.9")
    r = c.get("/v1/voices", headers={"Authorization": "Bearer ka"})
    assert r.status_code == 200 and "set-cookie" not in r.headers  # a key names its owner: no cookie
    r = c.get("/config")
    cookie = r.headers["set-cookie"]
    assert cookie.startswith("cosyvoice_visitor=") and "HttpOnly" in cookie and "Path=/" in cookie
    assert "set-cookie" not in c.get("/config").headers  # kept (TestClient's jar): the same visitor
    forged = client("203.0.113.9")
    forged.cookies.set("cosyvoice_visitor", cookie.split(";")[0].split("=", 1)[1].split(".")[0] + ".forged")
    assert forged.get("/config").headers["set-cookie"] != cookie  # a bad signature: a new visitor


def test_rate_limit_refusals_are_counted_by_reason(tmp_path):
    from fastapi.testclient import TestClient

    from app.config import load_config
    from app.server.main import build_server

    cfg = load_config(None, {"server.rate_limit_per_minute": 1, "server.voices_dir": str(tmp_path / "v"),
                             "model.dir": str(tmp_path / "missing")})
    c = TestClient(build_server(cfg), raise_server_exceptions=False)
    body = {"model": "cosyvoice2", "input": "hi", "voice": "x"}
    assert [c.post("/v1/audio/speech", json=body).status_code for _ in range(2)] == [503, 429]
    assert 'cosyvoice_refused_share_total{reason="rate_limit"} 1.0' in c.get("/metrics").text


def test_the_pages_synthesis_event_takes_the_rate_limit(tmp_path):
    """The Gradio API's `synthesize` is found by its `fn_index` in a queue/join (app/server/limits.py): it takes
    the client's rate limit, as /v1 does; a Gradio upgrade that renames or renumbers events fails here."""
    from fastapi.testclient import TestClient

    from app.config import load_config
    from app.server.main import build_server

    cfg = load_config(None, {"server.rate_limit_per_minute": 1, "server.voices_dir": str(tmp_path / "v"),
                             "model.dir": str(tmp_path / "missing")})
    c = TestClient(build_server(cfg), raise_server_exceptions=False)
    fn = next(d["id"] for d in c.get("/config").json()["dependencies"] if d.get("api_name") == "synthesize")
    join = {"data": ["hi"], "fn_index": fn, "session_hash": "rate-test", "trigger_id": None, "event_data": None}
    codes = [c.post("/gradio_api/queue/join", json=join).status_code for _ in range(2)]
    assert codes[0] != 429 and codes[1] == 429, codes
    assert 'cosyvoice_refused_share_total{reason="rate_limit"} 1.0' in c.get("/metrics").text


def test_scopes_and_shares_follow_who_can_be_told_apart():
    """Owners wherever identities exist (keys, a login, a proxy naming clients, a public bind); the shared store
    only on a local bind with none; the fair share wherever others reach the app; bench options off in public."""
    from app.config import load_config

    def of(**sets):
        cfg = load_config(None, {f"server.{k}": v for k, v in sets.items()})
        return cfg.voices.resolved(cfg.server), cfg.server.streams_per_client, cfg.server.bench_options_open

    assert of() == ("shared", 0, True)  # this machine alone
    for identity in ({"api_key": "k"}, {"api_keys": "alice:ka,bob:kb"}, {"admin_key": "a"}, {"auth": "u:p"}):
        assert of(**identity) == ("private", 0, True), identity  # 127.0.0.1 behind nginx, one key per owner
    assert of(trusted_proxies="127.0.0.1") == ("private", 2, True)  # a proxy names the clients: a share each
    assert of(host="0.0.0.0") == ("private", 2, False)  # a Space
    assert of(host="0.0.0.0", bench_options=True)[2] and not of(bench_options=False)[2]
    cfg = load_config(None, {"voices.scope": "shared", "server.api_key": "k"})
    assert cfg.voices.resolved(cfg.server) == "shared"  # said explicitly: kept


@pytest.fixture()
def public(tmp_path):
    """The app on a public bind (0.0.0.0, no keys: the page and /v1 open, as a Space), not started."""
    from fastapi.testclient import TestClient

    from app.config import load_config
    from app.server.main import build_server

    cfg = load_config(None, {"server.host": "0.0.0.0", "server.voices_dir": str(tmp_path / "v"),
                             "model.dir": str(tmp_path / "models" / "secret-folder")})
    app = build_server(cfg)
    return lambda ip: TestClient(app, raise_server_exceptions=False, client=(ip, 50000))


def test_a_stranger_on_a_public_bind_gets_no_bench_knob_no_versions_and_a_counted_upload_share(public):
    stranger, local = public("203.0.113.9"), public("127.0.0.1")
    body = {"model": "cosyvoice2", "input": "abc", "voice": "x", "fixed_tokens": 1500}
    r = stranger.post("/v1/audio/speech", json=body)
    assert r.status_code == 403 and r.json()["error"]["code"] == "bench_option_refused", r.text
    assert r.json()["error"]["param"] == "fixed_tokens" and r.json()["error"]["type"] == "permission_error"
    assert stranger.get("/health").json()["voices"] == "private"
    # /metrics: no Python version nor vLLM's engine arguments for a stranger; this machine's operator sees them
    assert "python_info" not in stranger.get("/metrics").text and "python_info" in local.get("/metrics").text
    # the page's API lists its documented events only (no per-session state such as the Stop signal)
    named = stranger.get("/gradio_api/info").json()["named_endpoints"]
    assert "/StopSignal" not in named and {"/synthesize", "/save_voice", "/transcribe"} <= set(named), sorted(named)
    # uploads count against the client's share: 60 a minute (twice its 30 synthesis requests), then 429
    # (the bucket refills one a second while this runs)
    t0, accepted = time.monotonic(), 0
    while (r := stranger.post("/gradio_api/upload", files={"files": ("a.txt", b"x" * 1024)})).status_code == 200:
        accepted += 1
        assert accepted <= 60 + (time.monotonic() - t0) + 1, "uploads are not counted"
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1 and accepted >= 60, (r.text, accepted)
    assert public("198.51.100.7").post("/gradio_api/upload", files={"files": ("a.txt", b"x")}).status_code == 200
    assert 'cosyvoice_refused_share_total{reason="uploads"} 1.0' in local.get("/metrics").text


# --- a signed-in Hugging Face user (the profile Gradio hands the page's handlers) --------------------------


def test_signed_in_users_keep_their_voices_apart(tiny_model_dir, tmp_path):
    import gradio as gr

    from app.config import CONFIG_DIR, load_config
    from app.service.service import StudioService
    from app.ui.handlers import Handlers

    cfg = load_config(CONFIG_DIR / "cpu.toml", {"model.dir": str(tiny_model_dir), "engine.backend": "torch",
                                               "server.voices_dir": str(tmp_path / "v"), "voices.scope": "private"})
    service = StudioService(cfg)

    def profile(user: str) -> gr.OAuthProfile:  # what Gradio builds from the signed-in session's userinfo
        return gr.OAuthProfile({"name": user.title(), "preferred_username": user,
                                "profile": f"https://huggingface.co/{user}", "picture": ""})

    alice, bob = profile("alice"), profile("bob")

    async def scenario():
        await service.start()
        assert service.ready and service.random_model, service.status  # the tiny model's mark
        h = Handlers(service)
        line, banner, _ = h.status()
        assert banner.visible and "random" in banner.value  # the page's notice: the output is noise
        assert "tiny" in line and str(tiny_model_dir) not in line and "/" not in line.split("model")[-1], line
        msg, name = await h.save_voice("mine", str(EXAMPLE_WAV), EXAMPLE_TRANSCRIPT, profile=alice)
        assert name == "mine" and "Saved voice" in msg
        assert [v["name"] for v in h.list_voices(profile=alice)] == ["mine"]
        assert h.list_voices(profile=bob) == [] and h.list_voices() == []  # bob, and a visitor without a cookie
        with pytest.raises(gr.Error, match="no saved voice"):  # bob cannot use it
            async for _ in h.synthesize("Hello.", None, "", "zero_shot", "", "mine", 1, 1.0, True, profile=bob):
                pass
        with pytest.raises(gr.Error, match="no saved voice"):  # nor delete it
            h.delete_voice("mine", profile=bob)
        outputs = [o async for o in h.synthesize("Hello.", None, "", "zero_shot", "", "mine", 1, 1.0, False,
                                                 profile=alice)]
        assert outputs[-1][3]["voice"] == "mine"  # alice can
        # the live panels: alice's tick shows her request, bob's none of it; neither sees a path or engine args
        from app.ui.handlers import viewer
        from app.ui.panels import refresh

        for who, n_rows in ((alice, 1), (bob, 0)):
            *_, table, facts = refresh(service, "en", viewer(None, who, frozenset()))
            assert len(table) == n_rows, (who.username, table)
            assert str(tiny_model_dir) not in facts and "engine" not in facts and "`private`" in facts, facts
        *_, table, facts = refresh(service, "en", viewer(None, alice, frozenset({"hf:alice"})))  # admin_users
        assert str(tiny_model_dir) in facts  # an admin's view: the facts with paths
        with pytest.raises(gr.Error, match="overwrite=True"):  # a taken name, said in API terms too
            await h.save_voice("mine", str(EXAMPLE_WAV), EXAMPLE_TRANSCRIPT, profile=alice)
        await h.save_voice("mine", str(EXAMPLE_WAV), "Replaced.", overwrite=True, profile=alice)
        assert h.delete_voice("mine", profile=alice)[0].startswith("Deleted")
        await service.aclose()

    asyncio.run(scenario())


# --- the real server: visitors, keys, the admin, the page, raised limits, the fair share ------------------

RAISED = {"max_text_chars": 2400, "max_transcript_chars": 1200, "max_instruct_chars": 600}
DEFAULTS = {"max_text_chars": 2000, "max_transcript_chars": 1000, "max_instruct_chars": 500}
LONG_TRANSCRIPT = ("The quick brown fox jumps over the lazy dog. " * 25)[:1100]  # between default and raised
LONG_INSTRUCTION = ("Speak slowly, calmly and warmly, like a storyteller by the fire. " * 9)[:550]
LONG_INPUT = ("Hello there, how are you today. " * 70)[:2100]


BASE = {"voices.scope": '"private"', "server.concurrency_limit": "4", "server.max_streams_per_client": "1",
        **{f"limits.{k}": str(v) for k, v in RAISED.items()}}  # both servers of this file


def _start(tiny_model_dir, tmp_path_factory, sets: dict[str, str]):
    from studio import run_studio

    return run_studio(tiny_model_dir, tmp_path_factory.mktemp("owners"), {**BASE, **sets})


@pytest.fixture(scope="module")
def server(studio_public):
    """/v1 without keys: visitors are their cookies; clients their X-Forwarded-For (127.0.0.1 is a trusted proxy).
    conftest.py's studio_public (shared with test_examples.py): BASE and the trusted proxy, among its keys."""
    from conftest import SHARED_SERVERS

    sets = SHARED_SERVERS["studio_public"]
    assert {**sets, **BASE, "server.trusted_proxies": '"127.0.0.1"'} == sets
    return studio_public[0]


@pytest.fixture(scope="module")
def keyed(tiny_model_dir, tmp_path_factory):
    """/v1 with two owners' keys and the admin key, on 127.0.0.1 with the scope left to "auto" (an app behind
    nginx): the keys alone make voices private."""
    sets = {"server.api_keys": '"alice:ka,bob:kb"', "server.admin_key": '"adm"', "voices.scope": '"auto"'}
    with _start(tiny_model_dir, tmp_path_factory, sets) as (base, _):
        yield base


def _save(client, base: str, name: str, transcript: str = EXAMPLE_TRANSCRIPT, **headers):
    with EXAMPLE_WAV.open("rb") as f:
        return client.post(f"{base}/v1/voices", files={"audio": ("ref.wav", f, "audio/wav")},
                           data={"transcript": transcript, "name": name}, headers=headers)


def _speak(client, base: str, voice: str, text: str = "Hello there.", **body):
    return client.post(f"{base}/v1/audio/speech", json={"model": "cosyvoice2", "input": text, "voice": voice,
                                                         "response_format": "pcm", "seed": 1, **body})


def test_visitors_cannot_see_use_or_delete_each_others_voices(server):
    import httpx

    assert all(RAISED[k] > DEFAULTS[k] for k in RAISED)
    a, b = httpx.Client(timeout=300), httpx.Client(timeout=300)  # two browsers: each keeps its cookie
    r = _save(a, server, "fox")
    assert r.status_code == 201 and "owner" not in r.json(), r.text
    assert b.get(f"{server}/v1/voices").status_code == 200
    assert a.cookies["cosyvoice_visitor"] != b.cookies["cosyvoice_visitor"]
    assert _save(a, server, "long", LONG_TRANSCRIPT).status_code == 201  # a raised [limits] holds on /v1/voices
    assert {v["id"] for v in a.get(f"{server}/v1/voices").json()["data"]} == {"fox", "long"}
    assert b.get(f"{server}/v1/voices").json()["data"] == []
    assert b.get(f"{server}/v1/voices/fox").status_code == 404
    r = _speak(b, server, "fox")
    assert r.status_code == 400 and r.json()["error"]["code"] == "voice_not_found"
    assert b.delete(f"{server}/v1/voices/fox").status_code == 404
    r = _speak(a, server, "fox", LONG_INPUT, fixed_tokens=2, instructions=LONG_INSTRUCTION)  # raised limits hold
    assert r.status_code == 200 and len(r.content) > 0, r.text[:300]
    assert _save(b, server, "fox").status_code == 201  # the same name for another owner: no clash

    from gradio_client import Client, handle_file
    from gradio_client.exceptions import AppError

    page_a = Client(f"{server}/", verbose=False, httpx_kwargs={"cookies": dict(a.cookies)})  # a's browser
    page_c = Client(f"{server}/", verbose=False)  # a third visitor (gradio_client keeps the cookie it is given)
    assert {v["name"] for v in page_a.predict(api_name="/list_voices")} == {"fox", "long"}
    assert page_c.predict(api_name="/list_voices") == []
    with pytest.raises(AppError, match="no saved voice"):
        page_c.predict(text="Hi.", prompt_audio=None, prompt_text="", mode="zero_shot", instruct_text="",
                       voice="fox", seed=1, speed=1.0, stream=False, api_name="/synthesize")
    with pytest.raises(AppError, match="no saved voice"):
        page_c.predict(voice="fox", api_name="/delete_voice")
    *_, details = page_a.predict(text="Hi.", prompt_audio=None, prompt_text="", mode="instruct",
                                        instruct_text=LONG_INSTRUCTION, voice="fox", seed=1, speed=1.0, stream=False,
                                        api_name="/synthesize")  # a raised limit through the page
    assert details["voice"] == "fox" and details["mode"] == "instruct"
    _, name = page_c.predict(name="mine", prompt_audio=handle_file(str(EXAMPLE_WAV)), prompt_text=LONG_TRANSCRIPT,
                               api_name="/save_voice")
    assert name == "mine" and [v["name"] for v in page_c.predict(api_name="/list_voices")] == ["mine"]
    assert "mine" not in {v["id"] for v in a.get(f"{server}/v1/voices").json()["data"]}
    assert a.delete(f"{server}/v1/voices/fox").json()["deleted"]  # the owner may


def test_api_keys_keep_voices_apart_and_the_admin_sees_all(keyed):
    import httpx

    alice, bob, admin = ({"Authorization": f"Bearer {k}"} for k in ("ka", "kb", "adm"))
    server, c = keyed, httpx.Client(timeout=300)
    assert c.get(f"{server}/v1/voices").status_code == 401  # keys configured: /v1 wants one
    assert _save(c, server, "hare", **alice).status_code == 201
    assert c.get(f"{server}/v1/voices", headers=bob).json()["data"] == []
    assert _speak(c, server, "hare").status_code == 401
    r = c.post(f"{server}/v1/audio/speech", headers=alice, json={"model": "cosyvoice2", "input": "Hi.",
                                                                 "voice": "hare", "response_format": "pcm"})
    assert r.status_code == 200 and len(r.content) > 0  # its owner may use it
    r = c.post(f"{server}/v1/audio/speech", headers=bob, json={"model": "cosyvoice2", "input": "Hi.",
                                                               "voice": "hare", "response_format": "pcm"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "voice_not_found"
    assert c.delete(f"{server}/v1/voices/hare", headers=bob).status_code == 404
    everything = c.get(f"{server}/v1/voices", headers=admin).json()["data"]
    assert ("hare", "key:alice") in {(v["id"], v["owner"]) for v in everything}
    assert c.get(f"{server}/v1/voices/hare", headers=admin, params={"owner": "key:alice"}).status_code == 200
    assert c.delete(f"{server}/v1/voices/hare", headers=admin, params={"owner": "key:alice"}).json()["deleted"]
    assert c.get(f"{server}/v1/voices", headers=alice).json()["data"] == []
    # /metrics for a key owner: vLLM's families name the model, not the exported folder; no versions, no engine
    # arguments. The admin key sees them all. (Forwarded: a request from this machine itself is an admin's.)
    away = {"X-Forwarded-For": "203.0.113.9"}
    text = c.get(f"{server}/metrics", headers={**alice, **away}).text
    assert 'model_name="tiny"' in text and "vllm:num_requests_running" in text, text[:500]
    assert "/" not in "".join(line for line in text.splitlines() if "model_name=" in line)
    assert "python_info" not in text and "cache_config_info" not in text
    text = c.get(f"{server}/metrics", headers={**admin, **away}).text
    assert "python_info" in text and "vllm:cache_config_info" in text


def _refused_streams(server: str) -> float:
    """/metrics' count of requests refused for a client's stream share (0 before the first)."""
    import httpx

    text = httpx.get(f"{server}/metrics", timeout=30).text
    found = re.search(r'^cosyvoice_refused_share_total\{reason="client_streams"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_one_clients_flood_leaves_another_clients_request_admitted(server):
    import threading

    import httpx

    # two clients (their addresses, as the trusted proxy says), each a browser keeping its visitor cookie
    alice, bob = (httpx.Client(timeout=300, headers={"X-Forwarded-For": ip}) for ip in ("198.51.100.1", "198.51.100.2"))
    for c in (alice, bob):
        assert _save(c, server, "share").status_code == 201
    long = {"model": "cosyvoice2", "input": "Keep talking for a while.", "response_format": "pcm", "fixed_tokens": 1500,
            "voice": "share"}
    started, release = threading.Event(), threading.Event()
    refused_before = _refused_streams(server)

    def hold() -> None:
        with alice.stream("POST", f"{server}/v1/audio/speech", json=long) as r:
            assert r.status_code == 200
            pieces = r.iter_bytes()  # one iterator, kept: a discarded one closes the response
            next(pieces)
            started.set()
            release.wait(120)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert started.wait(120)
        flood = [alice.post(f"{server}/v1/audio/speech", json=long) for _ in range(10)]  # 10x alice's share
        assert {r.status_code for r in flood} == {429}  # refused at once: no queue place taken from anybody
        err = flood[0].json()["error"]
        assert err["code"] == "client_share_exceeded" and int(flood[0].headers["retry-after"]) > 0
        r = bob.post(f"{server}/v1/audio/speech", json={**long, "fixed_tokens": 25})  # bob: within his share
        assert r.status_code == 200 and len(r.content) > 0
    finally:
        release.set()
        holder.join(timeout=300)
    assert _refused_streams(server) - refused_before == 10  # (the shared server may have refused earlier ones)


def test_two_browsers_see_only_their_own_voices_on_the_page(server):
    """Real Chromium: each browser context is a visitor (its HttpOnly cookie); a voice saved through /v1 with
    the browser's cookie shows in that page's saved-voice list and not in the other browser's."""
    from test_browser import CHROMIUM, CHROMIUM_ARGS, _need

    _need(Path(CHROMIUM).exists(), f"{CHROMIUM} is not installed")
    _need(importlib.util.find_spec("playwright") is not None, "the playwright package is missing")
    import playwright.sync_api as playwright

    def choices(page) -> list[str]:
        page.get_by_text("Saved voices", exact=True).click()  # open the accordion
        page.locator("#voice input").click()
        names = [li.inner_text().strip().split("\n")[-1] for li in page.locator("ul[role=listbox] li").all()]
        page.keyboard.press("Escape")
        return names

    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            pages = []
            for _ in range(2):
                page = browser.new_context().new_page()
                page.goto(server)
                page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('ready')",
                                       timeout=60_000)
                pages.append(page)
            a, b = pages
            cookie = [c for c in a.context.cookies() if c["name"] == "cosyvoice_visitor"]
            assert cookie and cookie[0]["httpOnly"] and "cosyvoice_visitor" not in a.evaluate("document.cookie")
            r = a.request.post(f"{server}/v1/voices", multipart={  # the browser's own cookie goes along
                "audio": {"name": "ref.wav", "mimeType": "audio/wav", "buffer": EXAMPLE_WAV.read_bytes()},
                "transcript": EXAMPLE_TRANSCRIPT, "name": "chrome-fox"})
            assert r.status == 201, r.text()
            for page in pages:
                page.reload()
                page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('ready')",
                                       timeout=60_000)
            assert "chrome-fox" in choices(a)
            assert "chrome-fox" not in choices(b)
            assert b.request.delete(f"{server}/v1/voices/chrome-fox").status == 404
            assert a.request.delete(f"{server}/v1/voices/chrome-fox").status == 200
        finally:
            browser.close()
