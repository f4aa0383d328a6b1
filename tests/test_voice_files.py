"""Voices as `.cvvoice` files (app/service/voice_file.py): the format's reader on made-up voices and bad files
(no server), then one `python app.py` (tiny model, private scope, a 1 MB upload limit) for export and import
through /v1/voices and the page's Gradio API: round trips, refusals that write nothing, owners kept apart.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from studio import EXAMPLE_TRANSCRIPT, EXAMPLE_WAV
from test_app_api import _voice

from app.service.voice_file import (
    ARRAY_DTYPES,
    MEDIA_TYPE,
    VoiceFileError,
    export_voice,
    import_voice,
    read_voice_file,
)
from app.service.voices import VoiceError, VoiceStore

FP = "0123456789abcdef"
MAX_BYTES = 1 << 20
KEYS = tuple(ARRAY_DTYPES)


def _v1() -> bytes:
    """A version-1 `.cvvoice` (a zip of voice.json and one .npy per array), a format no longer read."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("voice.json", json.dumps({"format": "cosyvoice2-voice", "version": 1}))
    return buf.getvalue()


def _st(data: bytes, arrays: dict | None = None, **meta_changes) -> bytes:
    """A safetensors voice file from `data` with arrays and metadata replaced (None drops a key)."""
    n = int.from_bytes(data[:8], "little")
    meta = {**json.loads(data[8:8 + n])["__metadata__"], **meta_changes}
    a = {**safetensors.numpy.load(data), **(arrays or {})}
    return safetensors.numpy.save({k: v for k, v in a.items() if v is not None},
                                  metadata={k: v for k, v in meta.items() if v is not None})


def _bad_v2(good: bytes) -> dict[str, tuple[bytes, str]]:
    """name -> (a bad safetensors voice file made from `good`, a phrase its refusal says)."""
    a, n = safetensors.numpy.load(good), int.from_bytes(good[:8], "little")
    h = good[8:n + 8].replace(b'"prompt_text":"', b'"prompt_text":"\\ud800', 1) + b"  "  # 8 more bytes
    tokens, mel = a["speech_tokens"], a["speech_mel"]
    nan_emb = a["embedding"].copy()
    nan_emb[0, 3] = np.nan
    return {
        "another model": (_st(good, model_fingerprint="fedcba9876543210"), "another model"),
        "empty": (b"", "empty"),
        "version 1": (_v1(), "format version 1, which is not supported any more; export it again"),
        "truncated": (good[: len(good) * 2 // 3], "not a readable .cvvoice file"),
        "corrupt header": (good[:8] + b"{]" + good[10:], "not a readable .cvvoice file"),
        "lone surrogate": (len(h).to_bytes(8, "little") + h + good[n + 8:], "not a readable .cvvoice file"),
        "not safetensors": (b"RIFF" + b"\0" * 100, "not a readable .cvvoice file"),
        "other format": (_st(good, format="something-else"), "not a CosyVoice2 Studio voice"),
        "newer version": (_st(good, version="3"), "update the server"),
        "version as word": (_st(good, version="two"), 'format version "two"'),
        "no transcript": (_st(good, prompt_text=None), "'prompt_text'"),
        "no metadata": (safetensors.numpy.save(a), "not a CosyVoice2 Studio voice"),
        "NaN seconds": (_st(good, prompt_seconds="nan"), "'prompt_seconds'"),
        "seconds not a number": (_st(good, created="yesterday"), "'created'"),
        "wrong seconds": (_st(good, prompt_seconds="99.0"), "prompt_seconds is 99.0"),
        "extra array": (_st(good, {"extra": np.zeros(1, np.float32)}), "holds the arrays"),
        "missing array": (_st(good, {"embedding": None}), "holds the arrays"),
        "float tokens": (_st(good, {"speech_tokens": tokens.astype(np.float32)}), "expected <i4"),
        "wrong-shape mel": (_st(good, {"speech_mel": mel[:, :, :79].copy()}), "speech_mel has shape"),
        "mel not 2 x tokens": (_st(good, {"speech_mel": mel[:, :-2].copy()}), "speech_mel has shape"),
        "wrong-shape embedding": (_st(good, {"embedding": a["embedding"][:, :191].copy()}), "embedding has"),
        "NaN embedding": (_st(good, {"embedding": nan_emb}), "NaN"),
        "NaN mel": (_st(good, {"speech_mel": np.full_like(mel, np.nan)}), "NaN or infinite"),
        "infinite mel": (_st(good, {"speech_mel": np.full_like(mel, np.inf)}), "NaN or infinite"),
        "token out of range": (_st(good, {"speech_tokens": np.full_like(tokens, 6561)}), "outside 0..6560"),
        "negative text id": (_st(good, {"prompt_text_ids": -a["prompt_text_ids"] - 1}), "outside"),
        "no tokens": (_st(good, {"speech_tokens": tokens[:, :0].copy()}), "speech_tokens has shape"),
        "over 30 s": (_st(good, {"speech_tokens": np.zeros((1, 751), np.int32)}), "1 <= P <= 750"),
    }


@pytest.fixture()
def exported(tmp_path) -> tuple[VoiceStore, bytes]:
    store = VoiceStore(tmp_path / "a", FP, owner="visitor:a")
    store.save("alice", _voice("你好, world"))
    return store, export_voice(store, "alice")[1]


def _snapshot(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()} \
        if root.exists() else {}


# --- the format, no server ---------------------------------------------------------------------------


def test_export_import_round_trip_is_exact(exported, tmp_path):
    a, data = exported
    assert export_voice(a, "alice")[1] == data  # the same voice exports to the same bytes
    assert set(safetensors.numpy.load(data)) == set(KEYS)  # plain safetensors: no pickle, no zip
    b = VoiceStore(tmp_path / "b", FP, owner="visitor:b")  # another deployment of the same model
    info = import_voice(b, data, max_bytes=MAX_BYTES)
    orig = a.info("alice")
    assert (info.name, info.prompt_text, info.prompt_seconds, info.created, info.model_fingerprint) == \
        (orig.name, orig.prompt_text, orig.prompt_seconds, orig.created, orig.model_fingerprint)
    assert info.owner == "visitor:b" and b.info("alice").owner == "visitor:b"  # the importer's
    renamed = import_voice(b, data, max_bytes=MAX_BYTES, name="bob")
    assert renamed.name == "bob" and sorted(b.names()) == ["alice", "bob"]
    want, got = a.load("alice"), b.load("bob")
    assert got.prompt_text == want.prompt_text
    for k in KEYS:
        x, y = getattr(want, k).numpy(), getattr(got, k).numpy()
        assert x.dtype == y.dtype and np.array_equal(x, y), k
    assert export_voice(b, "alice")[1] == data  # and back out, byte for byte


def test_taken_and_invalid_names_write_nothing(exported):
    a, data = exported
    before = _snapshot(a.root)
    with pytest.raises(VoiceError, match="exists already") as taken:
        import_voice(a, data, max_bytes=MAX_BYTES)
    assert taken.value.code == "exists"
    for bad in ("../evil", "a b", "x" * 65, ".hidden"):
        with pytest.raises(VoiceError, match="invalid voice name") as invalid:
            import_voice(a, data, max_bytes=MAX_BYTES, name=bad)
        assert invalid.value.code == "invalid_name", bad
    assert _snapshot(a.root) == before
    info = import_voice(a, data, max_bytes=MAX_BYTES, overwrite=True)  # same semantics as save
    assert info.name == "alice" and a.names() == ["alice"]


def test_bad_files_are_refused_with_the_reason_and_write_nothing(exported, tmp_path):
    _, good = exported
    store = VoiceStore(tmp_path / "b", FP, owner="visitor:b")
    store.save("keep", _voice("kept"))
    before = _snapshot(store.root)
    for case, (data, phrase) in _bad_v2(good).items():
        with pytest.raises(VoiceFileError) as e:
            import_voice(store, data, max_bytes=MAX_BYTES, name="new")
        assert phrase in str(e.value) and str(e.value).startswith("the voice file"), (case, str(e.value))
        assert e.value.code == ("other_model" if case == "another model" else "invalid_voice_file"), case
        assert _snapshot(store.root) == before and store.names() == ["keep"], case
    with pytest.raises(VoiceFileError, match="larger than 1 MB") as e:
        read_voice_file(good + b"\0" * MAX_BYTES, FP, max_bytes=MAX_BYTES)
    assert e.value.code == "file_too_large"
    with pytest.raises(VoiceFileError, match="still loading"):  # no fingerprint yet: nothing to check against
        import_voice(VoiceStore(tmp_path / "c", ""), good, max_bytes=MAX_BYTES)
    assert not (tmp_path / "c").exists()


def test_renamed_files_are_read(exported):
    odd, _ = read_voice_file(_st(exported[1], name="not a name!", extra_key="1"), FP, max_bytes=MAX_BYTES)
    assert odd.name == "not a name!"  # checked when stored (a rename makes it importable)


# --- the real server: /v1/voices and the page --------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from studio import run_studio

    sets = {"voices.scope": '"private"', "limits.max_upload_mb": "1"}
    with run_studio(tiny_model_dir, tmp_path_factory.mktemp("voice_files"), sets) as (base, tmp):
        yield base, tmp / "voices"


def _save(client, base: str, name: str) -> dict:
    r = client.post(f"{base}/v1/voices", files={"audio": ("ref.wav", EXAMPLE_WAV.read_bytes(), "audio/wav")},
                    data={"transcript": EXAMPLE_TRANSCRIPT, "name": name})
    assert r.status_code == 201, r.text
    return r.json()


def _import(client, base: str, data: bytes, **form: str):
    return client.post(f"{base}/v1/voices/import", files={"file": ("v.cvvoice", data, MEDIA_TYPE)}, data=form)


def test_voices_travel_between_visitors_through_v1_and_the_page(server, tmp_path):
    import httpx
    from gradio_client import Client, handle_file
    from gradio_client.exceptions import AppError

    base, folder = server
    a, b = httpx.Client(timeout=300), httpx.Client(timeout=300)  # two browsers: each its cookie
    fox = _save(a, base, "fox")
    r = a.get(f"{base}/v1/voices/fox/export")
    assert r.status_code == 200 and r.headers["content-type"] == MEDIA_TYPE, r.text[:300]
    assert r.headers["content-disposition"].startswith('attachment; filename="fox.cvvoice"')
    data = r.content
    real, features = read_voice_file(data, fox["model_fingerprint"], max_bytes=MAX_BYTES)  # the real frontend's
    p = features.n_prompt_tokens
    assert features.speech_mel.shape == (1, 2 * p, 80) and features.embedding.shape == (1, 192)
    assert real.prompt_seconds == fox["prompt_seconds"] and real.created == fox["created"]

    assert b.get(f"{base}/v1/voices/fox/export").status_code == 404  # another visitor's: unknown, as GET says
    assert b.get(f"{base}/v1/voices/fox").status_code == 404
    r = _import(b, base, data)
    assert r.status_code == 201, r.text
    got = r.json()
    assert "owner" not in got and got["warnings"] == []
    assert {k: got[k] for k in ("id", "prompt_text", "prompt_seconds", "created", "model_fingerprint")} == \
        {k: fox[k] for k in ("id", "prompt_text", "prompt_seconds", "created", "model_fingerprint")}
    assert b.get(f"{base}/v1/voices/fox/export").content == data  # b's copy: the same voice, byte for byte
    r = _import(b, base, data)
    assert r.status_code == 409 and r.json()["error"]["code"] == "voice_exists", r.text
    assert _import(b, base, data, name="fox2").status_code == 201
    assert _import(b, base, data, overwrite="true").status_code == 201
    r = _import(b, base, data, name="../x")
    assert r.status_code == 400 and r.json()["error"]["param"] == "name", r.text
    r = b.post(f"{base}/v1/audio/speech", json={"model": "cosyvoice2", "input": "Hi.", "voice": "fox2",
                                                "response_format": "pcm", "seed": 1, "fixed_tokens": 2})
    assert r.status_code == 200 and len(r.content) > 0, r.text[:300]  # the imported voice speaks
    assert {v["id"] for v in a.get(f"{base}/v1/voices").json()["data"]} == {"fox"}  # a's voices: untouched

    # refusals: a clear 4xx each, and not one file written anywhere under the voices folder
    listing, files = b.get(f"{base}/v1/voices").json(), _snapshot(folder)
    bads = _bad_v2(data)
    for case in ("another model", "version 1", "truncated", "extra array", "wrong-shape mel", "NaN embedding",
                 "NaN mel", "other format"):
        bad, phrase = bads[case]
        r = _import(b, base, bad, name="new")
        err = r.json()["error"]
        assert r.status_code == 400 and phrase in err["message"] and err["param"] == "file", (case, r.text)
        assert err["code"] == ("other_model" if case == "another model" else "invalid_voice_file"), case
    for size in (MAX_BYTES + 1, 3 * MAX_BYTES):  # over the limit: the route's cap or the read's, 413 either way
        r = _import(b, base, data + b"\0" * (size - len(data)), name="new")
        assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large", r.text
    assert b.get(f"{base}/v1/voices").json() == listing and _snapshot(folder) == files

    # the page (Gradio API): b exports, a third visitor imports; a taken name is refused there too
    page_b = Client(f"{base}/", verbose=False, httpx_kwargs={"cookies": dict(b.cookies)})
    page_c = Client(f"{base}/", verbose=False)
    path = page_b.predict(voice="fox", api_name="/export_voice")
    assert path.endswith("fox.cvvoice") and Path(path).read_bytes() == data
    with pytest.raises(AppError, match="no saved voice"):
        page_c.predict(voice="fox", api_name="/export_voice")  # c cannot export b's
    msg, name = page_c.predict(file=handle_file(path), overwrite=False, api_name="/import_voice")
    assert name == "fox" and msg.startswith("Imported voice **fox**"), msg
    assert [v["name"] for v in page_c.predict(api_name="/list_voices")] == ["fox"]
    with pytest.raises(AppError, match="exists already"):
        page_c.predict(file=handle_file(path), overwrite=False, api_name="/import_voice")
    bad = tmp_path / "bad.cvvoice"
    bad.write_bytes(_bad_v2(data)["another model"][0])
    with pytest.raises(AppError, match="another model"):
        page_c.predict(file=handle_file(str(bad)), overwrite=True, api_name="/import_voice")
    assert {v["id"] for v in a.get(f"{base}/v1/voices").json()["data"]} == {"fox"}
