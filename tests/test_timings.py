"""Word and character timings (issue 53 C): the real alignment code (app/model/align.py) on a random-weights
tiny Whisper built here (app/model/random/whisper.py, no download) and the example recordings, the placing of words
the aligner missed, SRT/WebVTT read back by a parser here and by ffmpeg, and an aligner that cannot load.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import subprocess
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from app.config import AsrConfig
from app.engine.requests import AudioChunk
from app.model.align import AlignedWords, WhisperAligner, dtw
from app.model.random.whisper import make_tiny_whisper
from app.model.words import WordSpan, split_words
from app.service.asr import Transcriber
from app.service.subtitles import MAX_CUE_CHARS, cues, to_srt, to_vtt
from app.service.timings import Aligner, AlignerUnavailable, TakeTimings, WordTiming, place_words, sentences_of

ASSETS = Path(__file__).resolve().parents[1] / "assets"
EN = "The quick brown fox jumps over the lazy dog."  # fits the tiny decoder's 60 token places
ZH = "今天天气很好，我们一起去公园散步吧。"  # 18 characters, 54 byte tokens


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_whisper(tmp_path_factory.mktemp("whisper") / "random", seed=1)


@pytest.fixture(scope="module")
def take(folder) -> tuple[TakeTimings, list[tuple[str, np.ndarray]]]:
    en, sr_en = sf.read(ASSETS / "prompt_en.wav", dtype="float32")
    zh, sr_zh = sf.read(ASSETS / "prompt_zh.wav", dtype="float32")
    assert sr_en == sr_zh == 24_000
    sentences = [(EN, en), (ZH, zh)]
    return asyncio.run(Aligner(AsrConfig(model_id=str(folder), device="cpu")).take(sentences)), sentences


def test_split_words():
    assert [w.text for w in split_words("“Hello there,” she said — ok")] == ["“Hello", "there,”", "she", "said —",
                                                                          "ok"]
    assert [w.text for w in split_words("今天好，OK吗？ 3.5 km")] == ["今", "天", "好，", "OK", "吗？", "3.5", "km"]
    assert [w.text for w in split_words(" ... ")] == ["..."] and split_words("  ") == []
    w = split_words("a  bc.")[1]
    assert (w.start_char, w.end_char, w.text) == (3, 6, "bc.")


def _dp_path_cost(cost: np.ndarray) -> float:
    """The cheapest path's cost by the plain recursion, cell by cell."""
    acc = np.full(cost.shape, np.inf)
    for i in range(cost.shape[0]):
        for j in range(cost.shape[1]):
            prev = 0.0 if i == j == 0 else min(acc[i - 1, j - 1] if i and j else np.inf,
                                              acc[i - 1, j] if i else np.inf, acc[i, j - 1] if j else np.inf)
            acc[i, j] = cost[i, j] + prev
    return float(acc[-1, -1])


def test_dtw_is_the_cheapest_monotone_path():
    rng = np.random.default_rng(0)
    for shape in [(1, 5), (5, 1), (4, 9), (9, 4), (12, 30)]:
        cost = rng.random(shape)
        rows, cols = dtw(cost)
        assert (rows[0], cols[0]) == (0, 0) and (rows[-1], cols[-1]) == (shape[0] - 1, shape[1] - 1)
        steps = np.stack([np.diff(rows), np.diff(cols)], axis=1)
        assert {tuple(s) for s in steps} <= {(1, 1), (1, 0), (0, 1)}
        assert cost[rows, cols].sum() == pytest.approx(_dp_path_cost(cost))
    diag = np.ones((3, 3)) - np.eye(3)  # free along the diagonal
    assert dtw(diag)[1].tolist() == [0, 1, 2]


def test_one_timing_per_word_monotone_inside_the_take(take):
    timings, sentences = take
    take_ms = sum(len(s) for _, s in sentences) * 1000 / 24_000
    for s, (text, _) in zip(timings.sentences, sentences, strict=True):
        assert [w.word for w in s.words] == [w.text for w in split_words(text)] and s.note == ""
    words = timings.words
    starts = [w.start_ms for w in words]
    assert starts == sorted(starts) and all(0 <= w.start_ms <= w.end_ms <= take_ms for w in words)
    assert all(a.end_ms <= b.start_ms for a, b in pairwise(words))  # no overlap either
    en, zh = timings.sentences
    assert en.start_ms == 0 and zh.start_ms == en.end_ms == round(len(sentences[0][1]) / 24)  # offset by sentence 1
    assert all(en.start_ms <= w.start_ms and w.end_ms <= en.end_ms for w in en.words)
    assert all(zh.start_ms <= w.start_ms and w.end_ms <= zh.end_ms for w in zh.words)
    assert zh.end_ms == round(take_ms)


def test_char_timings_agree_with_words(take):
    timings, _ = take
    for s in timings.sentences:
        c = s.chars
        assert "".join(c.chars) == s.text and len(c.start_ms) == len(c.duration_ms) == len(s.text)
        assert s.start_ms <= c.start_ms[0] and c.start_ms[-1] + c.duration_ms[-1] <= s.end_ms
        assert all(a + d <= b for a, d, b in zip(c.start_ms, c.duration_ms, c.start_ms[1:], strict=False))
        for span, w in zip(split_words(s.text), s.words, strict=True):
            inside = range(span.start_char, span.end_char)
            assert c.start_ms[inside[0]] == w.start_ms
            assert sum(c.duration_ms[k] for k in inside) == w.end_ms - w.start_ms
    whole = timings.chars.to_json()
    assert set(whole) == {"chars", "charStartTimesMs", "charDurationsMs"}
    assert "".join(whole["chars"]) == EN + ZH and whole["charStartTimesMs"] == sorted(whole["charStartTimesMs"])


def _aligned(spans: list[tuple[float, float]], duration_s: float = 2.0) -> AlignedWords:
    words = tuple(WordSpan(f"w{i}", 3 * i, 3 * i + 2) for i in range(len(spans)))
    return AlignedWords(words, tuple(s for s, _ in spans), tuple(e for _, e in spans), duration_s, (0.1, 1.9))


def test_missed_words_are_interpolated_and_marked():
    nan = float("nan")
    # w1 zero length, w3 out of order, w4 no tokens, w6 past the audio's end
    placed = place_words(_aligned([(0.1, 0.4), (0.4, 0.4), (0.4, 0.8), (0.5, 0.9), (nan, nan), (0.9, 1.2),
                                   (1.3, 2.5)]))
    assert [m for _, _, m in placed] == [False, True, False, True, True, False, True]
    assert all(e > s for s, e, _ in placed) and [s for s, _, _ in placed] == sorted(s for s, _, _ in placed)
    assert placed[1][0] == pytest.approx(0.25) and placed[1][1] == pytest.approx(0.6)  # halves of w0 and w2 lent
    assert placed[3][0] == placed[2][1] and placed[4][1] == placed[5][0]  # between its neighbours
    assert placed[6] == (1.2, 1.9, True)  # after the last sound word, up to the speech's end
    every = place_words(_aligned([(nan, nan)] * 4))  # nothing aligned: shared out over the speech
    assert [round(s, 3) for s, _, _ in every] == [0.1, 0.55, 1.0, 1.45] and all(m for *_, m in every)


def test_a_sentence_too_long_for_the_decoder_is_interpolated(folder):
    aligner = WhisperAligner.load(folder, "cpu")
    wave, sr = sf.read(ASSETS / "prompt_en.wav", dtype="float32")
    long_text = "The quick brown fox jumps over the lazy dog near the quiet river bank."
    got = aligner.align(wave, sr, long_text)
    assert "tokens, more than the decoder's 60" in got.note and np.isnan(got.start_s).all()
    placed = place_words(got)
    assert all(m for *_, m in placed) and placed[0][0] == got.speech_s[0] and placed[-1][1] == got.speech_s[1]
    assert "longer than Whisper's 30 s window" in aligner.align(np.zeros(31 * sr, np.float32), sr, "hi").note


def test_sentences_of_gathers_chunks_by_segment():
    chunks = [AudioChunk(np.full(n, seg, np.float32), i, seg, i == 2) for i, (seg, n) in enumerate([(0, 3), (0, 2),
                                                                                                  (1, 4)])]
    got = sentences_of(chunks, ["a", "b", "c"])
    assert [(t, len(s)) for t, s in got] == [("a", 5), ("b", 4), ("c", 0)]


def _parse(text: str) -> list[tuple[int, int, str]]:
    """(start_ms, end_ms, text) of each SRT or WebVTT cue (WebVTT's hours are optional: ffmpeg leaves them out)."""
    stamp = r"(?:(\d\d+):)?(\d\d):(\d\d)[,.](\d\d\d)"
    out = []
    for block in re.split(r"\n\n+", text.strip()):
        lines = block.splitlines()
        at = next((k for k, line in enumerate(lines) if "-->" in line), None)
        if at is None:
            continue
        a, b = (re.fullmatch(stamp, t.strip()).groups() for t in lines[at].split("-->"))
        ms = [((int(h or 0) * 60 + int(m)) * 60 + int(s)) * 1000 + int(f) for h, m, s, f in (a, b)]
        out.append((ms[0], ms[1], "\n".join(lines[at + 1:])))
    return out


def test_srt_and_vtt_read_back(take, tmp_path):
    timings, _ = take
    words = timings.words
    want = [(c.start_ms, c.end_ms, c.text) for c in cues(words)]
    assert all(len(t) <= MAX_CUE_CHARS for *_, t in want) and len(want) >= 2
    assert " ".join(t for *_, t in want).replace(" ", "") == "".join(w.word for w in words).replace(" ", "")
    assert want[0][2].startswith("The quick") and want[-1][2].endswith("吧。")  # a sentence's end closes its cue
    srt, vtt = to_srt(words), to_vtt(words)
    assert _parse(srt) == want and _parse(vtt) == want and vtt.startswith("WEBVTT\n\n")
    assert srt.splitlines()[0] == "1" and "00:00:00,000 --> " in srt
    assert "&lt;b&gt;" in to_vtt([WordTiming("<b>", 0, 5)])
    if shutil.which("ffmpeg") is None:
        pytest.skip("ffmpeg is not on PATH: the subtitle files were read back by this test's parser only")
    (tmp_path / "take.vtt").write_text(vtt, encoding="utf-8")
    (tmp_path / "take.srt").write_text(srt, encoding="utf-8")
    for src, dst in (("take.vtt", "out.srt"), ("take.srt", "out.vtt")):  # each read by ffmpeg, written as the other
        subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-y", "-i", src, dst], cwd=tmp_path, check=True,
                       timeout=30)
        back = _parse((tmp_path / dst).read_text(encoding="utf-8"))
        assert [(a, b) for a, b, _ in back] == [(a, b) for a, b, _ in want], dst
        assert [t.replace(" ", "") for *_, t in back] == [t.replace(" ", "") for *_, t in want], dst


def test_unavailable_aligner_says_why_once(monkeypatch, caplog):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    wave = np.zeros(2400, np.float32)

    async def main():
        off = Aligner(AsrConfig(model_id="openai/whisper-tiny-never-cached"))
        with caplog.at_level(logging.WARNING, logger="app.service.timings"):
            for _ in range(2):
                with pytest.raises(AlignerUnavailable, match="word timings are unavailable: cannot download"):
                    await off.take([("hello", wave)])
        assert len(caplog.records) == 1 and off.error
        no_dl = Aligner(AsrConfig(model_id="openai/whisper-tiny-never-cached", download=False))
        with pytest.raises(AlignerUnavailable, match=r"asr\.download is off"):
            await no_dl.sentence("hello", wave)
        with pytest.raises(AlignerUnavailable, match=r"\[asr\] enabled = false"):
            await Aligner(AsrConfig(enabled=False)).sentence("hello", wave)

    asyncio.run(main())


def test_the_aligner_uses_the_transcribers_whisper(folder):
    """One copy of the [asr] model: the aligner runs on the one the Transcriber loads (its attention now eager),
    and transcribing still works after."""
    async def main():
        cfg = AsrConfig(model_id=str(folder), device="cpu")
        asr = Transcriber(cfg)
        aligner = Aligner(cfg, asr)
        en, _ = sf.read(ASSETS / "prompt_en.wav", dtype="float32")
        got = await aligner.sentence(EN, en)
        assert [w.word for w in got.words] == [w.text for w in split_words(EN)]
        shared = await asr.model()  # loaded once, by the aligner's first sentence
        assert shared.model.config._attn_implementation == "eager" and aligner.transcriber is asr
        transcript = await asr.transcribe(ASSETS / "prompt_en.wav")
        assert transcript.language and isinstance(transcript.text, str)
        assert await asr.model() is shared

    asyncio.run(main())
