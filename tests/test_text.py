"""Text frontend: tokenizer ids and text_normalize against text.json, plus splitting rules."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from app.model.hparams import ModelFolderError
from app.model.text import (
    MERGE_LEN,
    TOKEN_MAX_N,
    TOKEN_MIN_N,
    TextFrontend,
    is_only_punctuation,
    replace_blank,
    spell_out_numbers,
    split_paragraph,
)
from app.model.tokenizer import SPECIAL_TOKENS, SpeechTextTokenizer


def word_count(text: str) -> int:
    # stand-in for the Qwen token count in tests that must not need the model folder
    return len(text.split())


@pytest.fixture(scope="module")
def text_json(parity: Path) -> dict:
    return json.loads((parity / "text.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tokenizer(parity_model_dir: Path) -> SpeechTextTokenizer:
    return SpeechTextTokenizer.from_dir(parity_model_dir / "CosyVoice-BlankEN")


# ---- parity ---------------------------------------------------------------------------------


@pytest.mark.parity
def test_tokenize_ids_exact(tokenizer, text_json):
    assert text_json["tokenize"], "text.json has no tokenize cases"
    for case in text_json["tokenize"]:
        assert tokenizer.encode(case["text"]) == case["ids"], case["text"]


@pytest.mark.parity
def test_special_token_ids_and_len(tokenizer, text_json):
    assert tokenizer.special_token_ids == text_json["special_token_ids"]
    assert len(tokenizer) == text_json["tokenizer_len"] == 151663
    new_ids = [tokenizer.special_token_ids[t] for t in SPECIAL_TOKENS]
    assert new_ids == list(range(151646, 151663))


@pytest.mark.parity
def test_text_normalize_wetext_exact(tokenizer, text_json):
    frontend = TextFrontend("wetext", tokenizer.count_tokens)
    cases = text_json["text_normalize"]
    assert text_json["backend"] == "wetext" and cases, "text.json has no wetext cases"
    for case in cases:
        text = case["text"]
        assert frontend.normalize(text) == case["split_true"], text
        assert frontend.normalize(text, split=False) == case["split_false"], text
        assert frontend.normalize(text, text_frontend=False) == case["text_frontend_false"], text


@pytest.mark.parity
def test_text_normalize_no_backend_exact(tokenizer, text_json):
    frontend = TextFrontend("none", tokenizer.count_tokens)
    cases = text_json["text_normalize_no_backend"]
    assert cases, "text.json has no text_normalize_no_backend cases"
    for case in cases:
        assert frontend.normalize(case["text"]) == case["split_true"], case["text"]
        assert frontend.normalize(case["text"], split=False) == case["split_false"], case["text"]


@pytest.mark.parity
def test_shared_frontend_across_threads(tokenizer, text_json):
    frontend = TextFrontend("wetext", tokenizer.count_tokens)  # fresh: FSTs load under contention
    cases = text_json["text_normalize"] * 2
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda c: frontend.normalize(c["text"]), cases))
    assert results == [c["split_true"] for c in cases]


# ---- tokenizer ------------------------------------------------------------------------------


@pytest.mark.parity
def test_encode_matches_specials(tokenizer):
    """Special-token strings become their ids (user text loses them before: app/service/inputs.py,
    tests/test_inputs.py::test_special_tokens_never_reach_the_lm_input), and decode drops them."""
    text = "You are a helpful assistant.<|endofprompt|>[breath]Hi"
    specials = set(tokenizer.special_token_ids.values())
    assert specials & set(tokenizer.encode(text)) == {151646, 151647}
    assert tokenizer.decode(tokenizer.encode(text)) == "You are a helpful assistant.Hi"
    assert tokenizer.count_tokens(text) == len(tokenizer.encode(text))


def test_tokenizer_folder_errors(tmp_path, parity_model_dir):
    missing = tmp_path / "nope"
    with pytest.raises(ModelFolderError, match="nope"):
        SpeechTextTokenizer.from_dir(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFolderError, match="empty"):
        SpeechTextTokenizer.from_dir(empty)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for name in ("tokenizer_config.json", "merges.txt"):
        shutil.copy(parity_model_dir / "CosyVoice-BlankEN" / name, corrupt / name)
    (corrupt / "vocab.json").write_text('{"a": ')
    with pytest.raises(ModelFolderError, match="corrupt"):
        SpeechTextTokenizer.from_dir(corrupt)


# ---- normalisation rules --------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["wetext", "none"])
def test_empty_and_blank_text(backend):
    frontend = TextFrontend(backend, word_count)
    assert frontend.normalize("") == [""]  # the official bypass returns the text itself
    assert frontend.normalize("", split=False) == ""
    assert frontend.normalize("  \n ") == []
    assert frontend.normalize("  \n ", split=False) == ""


@pytest.mark.parametrize("backend", ["wetext", "none"])
def test_special_tokens_bypass_normalisation(backend):
    frontend = TextFrontend(backend, word_count)
    text = " 我有3只猫<|endofprompt|>I have 12 dogs "
    assert frontend.normalize(text) == [text]
    assert frontend.normalize(text, split=False) == text
    # only the pair "<|" ... "|>" bypasses; without it the digits are spelled out
    assert frontend.normalize("I have 12 dogs [breath]", split=False).rstrip() == "I have twelve dogs [breath]"


def test_punctuation_only_segments_dropped():
    frontend = TextFrontend("none", word_count)
    assert frontend.normalize("...!?") == []
    assert frontend.normalize("“——”¥%") == []
    assert frontend.normalize("...!?", split=False) == "...!?"  # only segments are filtered
    assert frontend.normalize("Hi!!") == ["Hi!"]  # a sentence end right after another is dropped
    assert is_only_punctuation("") and is_only_punctuation("。，…$+")
    assert not is_only_punctuation(" .") and not is_only_punctuation("a.")


def test_long_zh_paragraph_is_split_within_limits():
    sentence = "春风吹过田野小草探出了头，" + "鸟儿在枝头欢快地唱歌。"  # 23 chars
    text = sentence * 20
    frontend = TextFrontend("wetext", word_count)
    segments = frontend.normalize(text)
    assert "".join(segments) == frontend.normalize(text, split=False) == text
    assert len(segments) >= 5
    for seg in segments[:-1]:
        assert TOKEN_MIN_N < len(seg) <= TOKEN_MAX_N and seg.endswith("。")
    assert len(segments[-1]) >= MERGE_LEN


def test_long_en_paragraph_is_split_within_limits():
    text = " ".join(f"Sentence {i} has a few more words in it." for i in range(40))
    frontend = TextFrontend("none", word_count)  # wetext's en FST needs seconds for 2000 chars
    normalised = frontend.normalize(text, split=False)
    assert "one" in normalised and "thirty-nine" in normalised and not any(c.isdigit() for c in normalised)
    segments = frontend.normalize(text)
    assert "".join(segments) == normalised
    assert len(segments) >= 4
    for seg in segments[:-1]:
        assert TOKEN_MIN_N < word_count(seg) <= TOKEN_MAX_N and seg.endswith(".")
    assert word_count(segments[-1]) >= MERGE_LEN


def test_short_tail_merges_into_previous_segment():
    body = "这是一个足够长的句子用来填满第一段。" * 4  # 72 chars
    segments = split_paragraph(body + "好的。", len, "zh")
    assert segments == [body + "好的。"]
    segments = split_paragraph(body + "这一句话本身已经超过了二十个字的长度所以单独成段。", len, "zh")
    assert len(segments) == 2 and segments[0] == body


def test_split_paragraph_quotes_and_appended_end():
    assert split_paragraph('A. "B." C', len, "en", token_max_n=5, token_min_n=1, merge_len=1) == [
        "A.",
        ' "B."',
        " C.",
    ]
    assert split_paragraph("没有标点", len, "zh") == ["没有标点。"]
    assert split_paragraph("no end", len, "en") == ["no end."]
    split_commas = split_paragraph("a,b", len, "en", token_max_n=1, token_min_n=0, merge_len=0, comma_split=True)
    assert split_commas == ["a,", "b."]


def test_zh_rules_without_backend():
    frontend = TextFrontend("none", word_count)
    out = frontend.normalize("（注意）【重要】 这是 ABC def 的测试 - 版本2.5，，", split=False)
    assert out == "注意重要这是ABC def的测试-版本2。5。"  # spaces next to CJK go before " - " is seen
    assert frontend.normalize("中文 A - B，、", split=False) == "中文A，B。"
    # blanks are judged before backticks are removed: "` -" keeps its space
    assert frontend.normalize("的`测试` - 版", split=False) == "的测试 -版"
    assert frontend.normalize("面积5m²和8m³——好", split=False) == "面积5m平方和8m立方 好"


def test_helpers():
    assert replace_blank("a b 中 文 c") == "a b中文c"
    assert replace_blank("x ") == "x"  # trailing space: dropped (the official code raises)
    assert spell_out_numbers("3 cats, 12 dogs", lambda s: f"<{s}>") == "<3> cats, <12> dogs"
    frontend = TextFrontend("none", word_count)
    assert frontend.normalize("I owe 0.5", split=False) == "I owe zero.five"
    huge = "9" * 50  # beyond inflect's range: spelled digit by digit instead of raising
    assert frontend.normalize(huge, split=False) == " ".join(["nine"] * 50)


def test_warmup_loads_backends():
    frontend = TextFrontend("wetext", word_count)
    frontend.warmup()
    assert frontend._tn._normalizer is not None and frontend._inflect is not None


def test_bad_backend():
    with pytest.raises(ValueError, match="backend"):
        TextFrontend("ttsfrd", word_count)  # type: ignore[arg-type]
