"""Dialogue scripts (app/service/dialogue.py): the parser, `prepare`'s checks before any audio, and the take
itself: a two-voice script through the Synthesizer is, sample for sample, the two turns spoken alone (the
official segment joins: each sentence its own LM request, seed + its index, and token->wave stream)."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import numpy as np
import pytest
from test_pipeline import EN_PROMPT, collect, make_synth

from app.config import load_config
from app.engine.pipeline import EmptyTextError
from app.engine.requests import SynthesisRequest, Turn
from app.service.dialogue import ScriptTurn, parse_script, speakers
from app.service.inputs import InputError
from app.service.metrics import Metrics
from app.service.prepare import SpeechInputs, prepare
from app.service.voices import VoiceStore

ZH_PROMPT = "今天天气很好，我们一起去公园散步吧。"  # assets/examples.json: prompt_zh.wav


def test_script_turns_keep_the_models_own_tags_and_the_lead():
    turns = parse_script("Once upon a time. [alice] Did you hear? [laughter] Wow. [bob-2] I did [breath] yes.")
    assert turns == [ScriptTurn("", "Once upon a time."), ScriptTurn("alice", "Did you hear? [laughter] Wow."),
                     ScriptTurn("bob-2", "I did [breath] yes.")]
    assert parse_script("[alice] Hi. [bob] Hello. [alice] Bye.")[2] == ScriptTurn("alice", "Bye.")
    assert parse_script("… [alice] Hi.") == [ScriptTurn("alice", "Hi.")]  # nothing speakable before the first tag
    assert speakers(turns, 2) == ["alice", "bob-2"]


@pytest.mark.parametrize("script, words", [
    ("No tags at all. [laughter]", "needs speaker tags"),
    ("[alice] Hi. [bob] [carol] Hello.", "Turn 2 ([bob]) has nothing to say"),
    ("[alice] Hi. [bob] !!!", "Turn 2 ([bob]) has nothing to say"),
])
def test_bad_scripts_are_refused_with_what_to_do(script, words):
    with pytest.raises(InputError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")) as e:
        parse_script(script)
    assert (e.value.param, e.value.code) == ("text", "invalid_dialogue")


def test_too_many_speakers_are_refused():
    turns = parse_script(" ".join(f"[v{i}] Hello." for i in range(4)))
    assert speakers(turns, 4) == ["v0", "v1", "v2", "v3"]
    with pytest.raises(InputError, match=r"4 speakers; the limit is 3 \(\[limits\] max_dialogue_speakers\)"):
        speakers(turns, 3)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    synth = make_synth(tiny_model_dir, nsf_noise=False)  # no NSF noise: a segment's audio depends on it alone
    fe = synth.model.frontend
    en = fe.voice_from_audio("assets/prompt_en.wav", EN_PROMPT)
    zh = fe.voice_from_audio("assets/prompt_zh.wav", ZH_PROMPT)
    yield synth, en, zh
    asyncio.run(synth.aclose())


def audio(synth, req) -> np.ndarray:
    chunks = asyncio.run(collect(synth, req))
    assert chunks[-1].is_final and chunks[-1].stats is not None
    return np.concatenate([c.samples for c in chunks])


def test_a_two_voice_dialogue_is_its_turns_spoken_alone(tiny):
    synth, en, zh = tiny
    a, b = "Good morning, how did you sleep?", "Very well, thank you."
    both = SynthesisRequest(text=f"[en] {a} [zh] {b}", voice=en, seed=5,
                            turns=(Turn(a, en, "en"), Turn(b, zh, "zh")))
    assert [(t.text, t.voice is zh) for t in synth.segments(both)] == [(a, False), (b, True)]
    chunks = asyncio.run(collect(synth, both))
    assert sorted({c.segment for c in chunks}) == [0, 1] and chunks[-1].stats.n_segments == 2
    together = np.concatenate([c.samples for c in chunks])
    first = audio(synth, SynthesisRequest(text=a, voice=en, seed=5))
    second = audio(synth, SynthesisRequest(text=b, voice=zh, seed=6))  # the second segment's LM seed: seed + 1
    np.testing.assert_array_equal(together, np.concatenate([first, second]))
    assert not np.array_equal(second, audio(synth, SynthesisRequest(text=b, voice=en, seed=6)))  # voices differ


def test_an_unspeakable_turn_is_refused_before_any_audio(tiny):
    synth, en, zh = tiny
    req = SynthesisRequest(text="…", voice=en, turns=(Turn("Hello.", en, "en"), Turn("…", zh, "zh")))
    with pytest.raises(EmptyTextError, match=r"turn 2 \(\[zh\]\) has nothing speakable"):
        synth.segments(req)


def test_prepare_resolves_speakers_and_refuses_unknown_ones(tiny, tmp_path):
    _, en, zh = tiny
    store = VoiceStore(tmp_path)
    store.save("alice", en)
    store.save("bob", zh)
    service = SimpleNamespace(cfg=load_config(overrides={"limits.max_dialogue_speakers": 2}), metrics=Metrics(),
                              voices=SimpleNamespace(of=lambda owner: store), require_ready=lambda: None)

    def run(**kw):
        return asyncio.run(prepare(service, SpeechInputs(dialogue=True, seed=1, **kw)))

    p = run(text="[alice] Hi there. [bob] Hello! [alice] Bye.")
    turns = p.request.turns
    assert [(t.speaker, t.text) for t in turns] == [("alice", "Hi there."), ("bob", "Hello!"), ("alice", "Bye.")]
    assert np.array_equal(turns[1].voice.embedding, zh.embedding) and turns[0].voice is turns[2].voice
    assert p.voice_name == "alice, bob" and p.request.voice is turns[0].voice and p.request.mode == "zero_shot"
    p = run(text="Our guests today. [bob] Hello!", voice="alice")  # the lead in the request's own voice
    assert [t.speaker for t in p.request.turns] == ["", "bob"] and p.voice_name == "alice, bob"
    for kw, words, code in [
        (dict(text="[alice] Hi. [carol] Hello."), re.escape("Unknown speaker [carol]: there is no saved voice named "
                                                            "carol; save a voice named carol first, or use one of: "
                                                            "alice, bob."), "voice_not_found"),
        (dict(text="Hello all. [bob] Hi."), "Text before the first speaker tag needs a voice", "invalid_dialogue"),
        (dict(text="[alice] A. [bob] B. [x] C."), "3 speakers; the limit is 2", "invalid_dialogue"),
    ]:
        with pytest.raises(InputError, match=words) as e:
            run(**kw)
        assert (e.value.param, e.value.code) == ("text", code), kw
    assert service.metrics.counters()["refused_inputs"] == {"voice_not_found": 1, "invalid_dialogue": 2}


def test_the_unknown_speaker_message_reads_in_chinese_too():
    """The page says the same refusal in Chinese (its key, app/ui/locales/messages.toml), with the names kept."""
    from app.service.prepare import load_voice
    from app.service.voices import VoiceError
    from app.ui.i18n import say

    def refused(names: list[str]) -> InputError:  # a script's [carol] where the owner's voices are `names`
        def load(name: str):
            raise VoiceError(f"no saved voice named {name!r}", code="not_found")

        store = SimpleNamespace(load=load, names=lambda: names)
        with pytest.raises(InputError) as e:
            asyncio.run(load_voice(SimpleNamespace(voices=SimpleNamespace(of=lambda owner: store)), "carol",
                                   param="text"))
        return e.value

    head = "Unknown speaker [carol]: there is no saved voice named carol; save a voice named carol first"
    listed, none = refused(["alice", "bob"]), refused([])
    assert (str(listed), str(none)) == (head + ", or use one of: alice, bob.", head + " (no voices are saved yet).")
    assert say(listed, "zh") == ("未知的说话人 [carol]：没有名为 carol 的已保存声音；请先保存名为 carol 的声音，"
                                 "或使用其中之一：alice, bob。"), say(listed, "zh")
    assert say(none, "zh").startswith("未知的说话人 [carol]：") and "目前还没有已保存的声音" in say(none, "zh")
