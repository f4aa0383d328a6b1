"""Voices as `.cvvoice` files (app/service/voice_file.py): the format's reader on made-up voices and bad files
(no server), then one `python app.py` (tiny model, private scope, a 1 MB upload limit) for export and import
through /v1/voices and the page's Gradio API: round trips, refusals that write nothing, owners kept apart.
"""

from __future__ import annotations

import io
import json
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from studio import EXAMPLE_TRANSCRIPT, EXAMPLE_WAV
from test_app_api import _voice

from app.service.voice_file import (
    ARRAY_DTYPES,
    MAX_MEMBER_BYTES,
    MEDIA_TYPE,
    MEMBERS,
    VoiceFileError,
    export_voice,
    import_voice,
    read_voice_file,
)
from app.service.voices import VoiceError, VoiceStore

FP = "0123456789abcdef"
MAX_BYTES = 1 << 20
KEYS = tuple(ARRAY_DTYPES)


def _v1(data: bytes) -> bytes:
    """The version-1 `.cvvoice` of the voice in safetensors `data`: the old writer's logic (a zip of voice.json
    and one .npy per array)."""
    arrays = safetensors.numpy.load(data)
    m = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    meta = {"format": "cosyvoice2-voice", "version": 1, "name": m["name"], "prompt_text": m["prompt_text"],
            "prompt_seconds": float(m["prompt_seconds"]), "created": float(m["created"]),
            "model_fingerprint": m["model_fingerprint"],
            "arrays": {k: {"dtype": a.dtype.str, "shape": list(a.shape)} for k, a in arrays.items()}}
    return _zip({"voice.json": json.dumps(meta, ensure_ascii=False, indent=1).encode(),
                 **{f"{k}.npy": _npy(a) for k, a in arrays.items()}})


def _st(data: bytes, arrays: dict | None = None, **meta_changes) -> bytes:
    """A safetensors voice file from `data` with arrays and metadata replaced (None drops a key)."""
    n = int.from_bytes(data[:8], "little")
    meta = {**json.loads(data[8:8 + n])["__metadata__"], **meta_changes}
    a = {**safetensors.numpy.load(data), **(arrays or {})}
    return safetensors.numpy.save({k: v for k, v in a.items() if v is not None},
                                  metadata={k: v for k, v in meta.items() if v is not None})


def _bad_v2(good: bytes) -> dict[str, tuple[bytes, str]]:
    """name -> (a bad safetensors voice file made from `good`, a phrase its refusal says)."""
    a = safetensors.numpy.load(good)
    mel = a["speech_mel"]
    return {
        "another model": (_st(good, model_fingerprint="fedcba9876543210"), "another model"),
        "truncated": (good[: len(good) * 2 // 3], "not a readable .cvvoice file"),
        "corrupt header": (good[:8] + b"{]" + good[10:], "not a readable .cvvoice file"),
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
        "float tokens": (_st(good, {"speech_tokens": a["speech_tokens"].astype(np.float32)}), "expected <i4"),
        "wrong-shape mel": (_st(good, {"speech_mel": mel[:, :, :79].copy()}), "speech_mel has shape"),
        "NaN mel": (_st(good, {"speech_mel": np.full_like(mel, np.nan)}), "NaN or infinite"),
        "token out of range": (_st(good, {"speech_tokens": np.full_like(a["speech_tokens"], 6561)}), "outside"),
    }


def _members(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {n: z.read(n) for n in z.namelist()}


def _zip(members: dict[str, bytes] | list[tuple[str, bytes]], method: int = zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as z, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Duplicate name": the point of one bad file
        for name, raw in (members.items() if isinstance(members, dict) else members):
            z.writestr(name, raw)
    return buf.getvalue()


def _npy(a: np.ndarray, allow_pickle: bool = False) -> bytes:
    f = io.BytesIO()
    np.save(f, a, allow_pickle=allow_pickle)
    return f.getvalue()


def _arrays(data: bytes) -> dict[str, np.ndarray]:
    return {k: np.load(io.BytesIO(raw), allow_pickle=False) for k, raw in
            ((n.removesuffix(".npy"), r) for n, r in _members(data).items() if n.endswith(".npy"))}


def _edit_meta(data: bytes, **changes) -> bytes:
    m = _members(data)
    meta = json.loads(m["voice.json"])
    m["voice.json"] = json.dumps({**meta, **changes}).encode()
    return _zip(m)


def _with_array(data: bytes, key: str, a: np.ndarray) -> bytes:
    """`data` with array `key` replaced by `a`, voice.json saying so (consistent, so the array's own checks answer)."""
    m = _members(data)
    meta = json.loads(m["voice.json"])
    meta["arrays"][key] = {"dtype": a.dtype.str, "shape": list(a.shape)}
    m["voice.json"], m[f"{key}.npy"] = json.dumps(meta).encode(), _npy(a)
    return _zip(m)


def _giant_header(dtype: str = "<f4") -> bytes:
    """A .npy whose header claims 10^12 elements over 8 bytes of data (a reader that trusts it allocates 4 TB)."""
    header = f"{{'descr': '{dtype}', 'fortran_order': False, 'shape': (1, 1000000000000), }}".encode()
    header += b" " * (63 - (10 + len(header)) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + b"\0" * 8


def _bad_files(good: bytes) -> dict[str, tuple[bytes, str]]:
    """name -> (a bad file made from `good`, a phrase its refusal says)."""
    a = _arrays(good)
    m = _members(good)
    tokens, mel = a["speech_tokens"], a["speech_mel"]
    nan_emb = a["embedding"].copy()
    nan_emb[0, 3] = np.nan
    fortran = _members(_with_array(good, "embedding", np.asfortranarray(np.tile(a["embedding"], (2, 1)))))
    return {
        "another model": (_edit_meta(good, model_fingerprint="fedcba9876543210"), "another model"),
        "truncated": (good[: len(good) * 2 // 3], "not a readable .cvvoice archive"),
        "cut mid-array": (_zip({**m, "speech_mel.npy": m["speech_mel.npy"][:-100]}), "data bytes"),
        "empty": (b"", "empty"),
        "extra member": (_zip({**m, "notes.txt": b"hi"}), "'notes.txt'"),
        "../ member": (_zip({**{k: v for k, v in m.items() if k != "embedding.npy"},
                             "../embedding.npy": m["embedding.npy"]}), "'../embedding.npy'"),
        "absolute member": (_zip({**m, "/etc/cron.d/x": b"x"}), "'/etc/cron.d/x'"),
        "member twice": (_zip([*m.items(), ("embedding.npy", m["embedding.npy"])]), "embedding.npy twice"),
        "missing member": (_zip({k: v for k, v in m.items() if k != "embedding.npy"}), "lacks embedding.npy"),
        "zip bomb": (_zip({**m, "speech_mel.npy": b"\0" * (MAX_MEMBER_BYTES + 1)}, zipfile.ZIP_DEFLATED),
                     "unpacked"),
        "other format": (_edit_meta(good, format="something-else"), "not a CosyVoice2 Studio voice"),
        "newer version": (_edit_meta(good, version=3), "update the server"),
        "version as text": (_edit_meta(good, version="1"), 'format version "1"'),
        "json list": (_zip({**m, "voice.json": b"[1, 2]"}), "not a CosyVoice2 Studio voice"),
        "deep json": (_zip({**m, "voice.json": b"[" * 100_000 + b"]" * 100_000}), "not valid JSON"),
        "wrong arrays": (_edit_meta(good, arrays={"x": {}}), "lists arrays"),
        "no transcript": (_edit_meta(good, prompt_text=None), "'prompt_text'"),
        "lone surrogate": (_zip({**m, "voice.json": m["voice.json"].replace(b'"prompt_text": "',
                                                                            b'"prompt_text": "\\ud800')}),
                           "not valid text"),
        "NaN seconds": (_edit_meta(good, prompt_seconds=float("nan")), "'prompt_seconds'"),
        "wrong seconds": (_edit_meta(good, prompt_seconds=99.0), "prompt_seconds is 99.0"),
        "json lies": (_edit_meta(good, arrays={**json.loads(m["voice.json"])["arrays"],
                                               "embedding": {"dtype": "<f4", "shape": [1, 191]}}), "inconsistent"),
        "wrong-shape mel": (_with_array(good, "speech_mel", mel[:, :, :79].copy()), "speech_mel has shape"),
        "mel not 2 x tokens": (_with_array(good, "speech_mel", mel[:, :-2].copy()), "speech_mel has shape"),
        "wrong-shape embedding": (_with_array(good, "embedding", a["embedding"][:, :191].copy()), "embedding has"),
        "NaN embedding": (_with_array(good, "embedding", nan_emb), "NaN"),
        "infinite mel": (_with_array(good, "speech_mel", np.full_like(mel, np.inf)), "NaN or infinite"),
        "token out of range": (_with_array(good, "speech_tokens", np.full_like(tokens, 6561)), "outside 0..6560"),
        "negative text id": (_with_array(good, "prompt_text_ids", -a["prompt_text_ids"] - 1), "outside"),
        "no tokens": (_with_array(good, "speech_tokens", tokens[:, :0].copy()), "speech_tokens has shape"),
        "over 30 s": (_with_array(good, "speech_tokens", np.zeros((1, 751), np.int32)), "1 <= P <= 750"),
        "float tokens": (_with_array(good, "speech_tokens", tokens.astype(np.float32)), "expected <i4"),
        "big-endian mel": (_with_array(good, "speech_mel", mel.astype(">f4")), "expected <f4"),
        "Fortran order": (_zip({**m, "embedding.npy": fortran["embedding.npy"]}), "Fortran"),
        "object array": (_zip({**m, "embedding.npy": _npy(np.array([{"a": 1}], dtype=object), True)}), "|O"),
        "giant header": (_zip({**m, "speech_mel.npy": _giant_header()}), "data bytes"),
        "not npy": (_zip({**m, "embedding.npy": b"PK\3\4 not an array"}), "not a NumPy array"),
    }


@pytest.fixture()
def exported(tmp_path) -> tuple[VoiceStore, bytes]:
    store = VoiceStore(tmp_path / "a", FP, owner="visitor:a")
    store.save("alice", _voice("你好, world"))
    return store, export_voice(store, "alice")[1]


@pytest.fixture()
def legacy(exported) -> bytes:
    return _v1(exported[1])


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


def test_old_voice_files_still_import(exported, legacy, tmp_path):
    a, data = exported
    b = VoiceStore(tmp_path / "b", FP, owner="visitor:b")
    info = import_voice(b, legacy, max_bytes=MAX_BYTES)
    assert (info.name, info.created, info.prompt_text) == ("alice", a.info("alice").created, "你好, world")
    assert sorted(_members(legacy)) == sorted(MEMBERS)
    assert export_voice(b, "alice")[1] == data  # the same voice as the new format's


def test_old_store_entries_load_and_are_converted(tmp_path):
    """A folder written by the old store (.npz arrays + .json info) reads as before, then holds .safetensors."""
    voice, root = _voice("old one"), tmp_path / "old"
    root.mkdir()
    np.savez(root / "old.npz", **voice.to_arrays())
    meta = {"name": "old", "prompt_text": "old one", "prompt_seconds": round(voice.n_prompt_tokens / 25, 2),
            "created": 1700000000.5, "model_fingerprint": FP, "owner": "visitor:o"}
    (root / "old.json").write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")
    store = VoiceStore(root, FP)
    assert [v.to_dict() for v in store.list()] == [meta]
    assert sorted(p.name for p in root.iterdir()) == ["old.safetensors"]
    got = store.load("old")
    assert got.prompt_text == "old one"
    for k in KEYS:
        assert np.array_equal(getattr(got, k).numpy(), getattr(voice, k).numpy()), k
    (root / "bad.json").write_text(json.dumps({**meta, "name": "bad"}))  # a damaged pair is kept, not lost
    (root / "bad.npz").write_bytes(b"PK not an npz")
    with pytest.raises(VoiceError) as e:
        store.load("bad")
    assert e.value.code == "damaged" and (root / "bad.json").exists() and (root / "bad.npz").exists()
    store.delete("bad")
    assert sorted(p.name for p in root.iterdir()) == ["old.safetensors"]


def test_bad_files_are_refused_with_the_reason_and_write_nothing(exported, legacy, tmp_path):
    _, good = exported
    store = VoiceStore(tmp_path / "b", FP, owner="visitor:b")
    store.save("keep", _voice("kept"))
    before = _snapshot(store.root)
    for case, (data, phrase) in [*_bad_files(legacy).items(), *_bad_v2(good).items()]:
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


def test_deflated_and_renamed_files_are_read(exported, legacy):
    good = legacy
    assert read_voice_file(_zip(_members(good), zipfile.ZIP_DEFLATED), FP, max_bytes=MAX_BYTES).name == "alice"
    odd = read_voice_file(_edit_meta(good, name="not a name!", extra_key=1), FP, max_bytes=MAX_BYTES)
    assert odd.name == "not a name!"
    odd = read_voice_file(_st(exported[1], name="not a name!", extra_key="1"), FP, max_bytes=MAX_BYTES)
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
    real = read_voice_file(data, fox["model_fingerprint"], max_bytes=MAX_BYTES)  # what the real frontend makes
    p = real.features.n_prompt_tokens
    assert real.features.speech_mel.shape == (1, 2 * p, 80) and real.features.embedding.shape == (1, 192)
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
    legacy = _v1(data)
    bads = {**_bad_files(legacy), **{f"v2 {k}": v for k, v in _bad_v2(data).items()}}
    for case in ("another model", "truncated", "extra member", "../ member", "wrong-shape mel", "NaN embedding",
                 "zip bomb", "giant header", "v2 truncated", "v2 extra array", "v2 NaN mel", "v2 other format"):
        bad, phrase = bads[case]
        r = _import(b, base, bad, name="new")
        err = r.json()["error"]
        assert r.status_code == 400 and phrase in err["message"] and err["param"] == "file", (case, r.text)
        assert err["code"] == ("other_model" if case == "another model" else "invalid_voice_file"), case
    for size in (MAX_BYTES + 1, 3 * MAX_BYTES):  # over the limit: the route's cap or the read's, 413 either way
        r = _import(b, base, data + b"\0" * (size - len(data)), name="new")
        assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large", r.text
    assert b.get(f"{base}/v1/voices").json() == listing and _snapshot(folder) == files
    assert _import(b, base, legacy, name="fox_v1").status_code == 201  # an old file still imports
    v1 = safetensors.numpy.load(b.get(f"{base}/v1/voices/fox_v1/export").content)
    assert all(np.array_equal(v1[k], v) for k, v in safetensors.numpy.load(data).items())

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
