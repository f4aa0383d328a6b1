"""The page in Chinese and the instruct presets: the tables and functions, then a real browser whose language
is Chinese, which gets the Chinese page, transcribes a reference (a rigged tiny Whisper, app/model/random/whisper.py)
and picks a preset. Saves out/studio_zh.png.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from studio import EXAMPLE_WAV
from test_browser import CHROMIUM, CHROMIUM_ARGS, _need

from app.config import LimitsConfig
from app.message import messages
from app.model.random.whisper import RIGGED_WORD
from app.model.tokenizer import SPECIAL_TOKENS
from app.service.inputs import check_instruct
from app.ui import i18n
from app.ui.panels import catalog
from app.ui.presets import PRESETS, apply_preset, preset_choices

REPO = Path(__file__).resolve().parents[1]
SCREENSHOT = REPO / "out" / "studio_zh.png"
CJK = re.compile(r"[\u4e00-\u9fff]")


def test_every_label_and_message_has_chinese():
    en_labels, zh_labels = i18n.labels("en"), i18n.labels("zh")
    assert set(en_labels) == set(zh_labels)
    for key in en_labels:
        assert CJK.search(zh_labels[key]), key
    for key, message in messages()["messages"].items():
        en, zh = message.get("en"), message["zh"]
        assert CJK.search(zh) or zh == "{error}", key
        if en is not None:  # the page's own line: its English here too
            assert not CJK.search(en), key
            assert re.findall(r"{(\w+)", en) == re.findall(r"{(\w+)", zh), key  # the same fields
    # pop-up titles; the panels' axes, legends, columns, facts
    for table in (messages()["titles"], catalog()["words"]):
        for en, zh in table.items():
            assert CJK.search(zh) or en == zh == "MiB", en
    PANEL_TEXT = catalog()["text"]
    assert set(PANEL_TEXT["en"]) == set(PANEL_TEXT["zh"])
    for key, en in PANEL_TEXT["en"].items():
        assert CJK.search(PANEL_TEXT["zh"][key]), key
        assert re.findall(r"{(\w+)", en) == re.findall(r"{(\w+)", PANEL_TEXT["zh"][key]), key
    words = i18n.locale("page")  # the page player's own words (player.js)
    assert set(words["en"]) == set(words["zh"])
    for key, en in words["en"].items():
        assert CJK.search(words["zh"][key]) and sorted(re.findall(r"{(\w+)", en)) == sorted(
            re.findall(r"{(\w+)", words["zh"][key])), key


def test_every_line_the_page_shows_is_translated():
    """The stats line under both players (from the take's details), in Chinese for a Chinese page, the same
    English for an API client; the numbers are kept, the mode named as the Mode radio names it."""
    from app.engine.requests import RequestStats
    from app.service.metrics import RequestRecord
    from app.ui.takes import stopped_take, take_line

    stats = RequestStats(ttfa_ms=123.4, wall_s=1.0, audio_s=2.0, n_tokens=25, n_segments=1, n_chunks=2, lm_s=0.1,
                         flow_s=0.2, hift_s=0.3)  # RTF 0.5, 25 tokens/s
    rec = RequestRecord(seq=1, t=0.0, outcome="ok", queue_wait_s=0.25, request_id="a" * 32, seed=11,
                        mode="zero_shot", stats=stats)
    details = rec.details()
    line = take_line(details, "en")  # API clients: the machine-stable English
    assert line == ("TTFA 123 ms · RTF 0.50 · 25.0 tokens/s · audio 2.00 s · LM 0.10 s · flow 0.20 s · vocoder 0.30 s"
                    " · queue 0.25 s · reference 0.00 s · mode zero_shot · seed 11"), line
    zh = take_line(details, "zh")
    assert zh.startswith("首音延迟 123 毫秒 · 实时率 0.50") and "种子 11" in zh and "声码器 0.30 秒" in zh, zh
    assert not re.search(r"\b(?:ms|tokens|audio|queue|reference|seed)\b", zh), zh
    assert "模式 零样本克隆 · 种子 11" in zh and "zero_shot" not in zh, zh
    player = {**details, "player": "webaudio", "client": {"first_byte_ms": 80.4, "first_sound_ms": None}}
    assert take_line(player, "en") == line + " · player **low-latency** · click → first byte 80 ms → first sound –"
    assert take_line(player, "zh") == zh + " · 播放器 **低延迟** · 点击 → 首字节 80 毫秒 → 首个声音 –"
    assert take_line({**details, "notes": ["a note"]}, "zh").endswith("种子 11\n\n- a note")
    stopped = stopped_take("a" * 32, 11, 74_880, "zero_shot")
    assert take_line(stopped, "en") == "Stopped: kept 3.12 s of audio · mode zero_shot · seed 11"
    assert take_line(stopped, "zh") == "已停止：保留了 3.12 秒音频 · 模式 零样本克隆 · 种子 11"
    assert "模式 指令控制 · 种子 11" in take_line(stopped_take("a" * 32, 11, 74_880, "instruct"), "zh")
    assert take_line(stopped_take("a" * 32, 11, 74_880), "en") == "Stopped: kept 3.12 s of audio · seed 11"
    assert take_line({"error": "boom"}, "zh") == take_line(None, "zh") == ""  # no take: no line
    for title in ("Busy", "Not ready", "Name taken", "Not an audio file", "Error"):
        assert CJK.search(i18n.title_in(title, "zh")) and i18n.title_in(title, "en") == title


def message_sites() -> dict[str, set[str]]:
    """Key -> its English templates, of every `Message(key, template, ...)` in app/ (found by reading the code)."""
    import ast

    sites: dict[str, set[str]] = {}
    for path in sorted(set((REPO / "app").rglob("*.py")) - {REPO / "app" / "message.py"}):  # (its class: no site)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "Message":
                key, template = node.args[:2]
                assert isinstance(key, ast.Constant) and isinstance(template, ast.Constant), (path, node.lineno)
                sites.setdefault(key.value, set()).add(template.value)
    return sites


def fields(template: str) -> set[str]:
    import string

    return {f.split(".")[0].split("[")[0] for _, f, _, _ in string.Formatter().parse(template) if f}


def untranslated(sites: dict[str, set[str]], table: dict) -> list[str]:
    """The keys of `sites` with no Chinese in `table`, or whose Chinese names a field their English lacks (it may
    leave one out), or that are said with two different Englishes."""
    return [key for key, templates in sites.items()
            if len(templates) != 1 or "zh" not in table.get(key, {})
            or not fields(table[key]["zh"]) <= fields(next(iter(templates)))]


def test_every_message_key_has_its_chinese():
    """The messages.toml table tied to the code: every key said in app/ has its Chinese with its fields, and every
    Chinese without an English there belongs to a key the code says; a missing one fails."""
    from app.message import Message

    sites, table = message_sites(), messages()["messages"]
    assert len(sites) > 60 and untranslated(sites, table) == [], untranslated(sites, table)
    assert {k for k, v in table.items() if "en" not in v} == set(sites)
    assert untranslated(sites, {k: v for k, v in table.items() if k != "no_stream"}) == ["no_stream"]
    for key, (template,) in sites.items():  # each renders in both languages
        said = Message(key, template, **dict.fromkeys(fields(template), 1.0))
        assert i18n.say(said, "en") == said and (CJK.search(i18n.say(said, "zh")) or key == "decoders_tried"), key


def test_engine_messages_translate():
    """What the engine raises is said in Chinese by its key, its fields kept (a field that is a message said too);
    English as raised for API clients; any other text as it is."""
    from app.config import load_config
    from app.service.inputs import InputError, check_seed, check_text
    from app.service.service import NotReadyError, StudioService

    for call, part in ((lambda: check_text(" ", 10), "请输入要朗读的文本"),
                       (lambda: check_text("a" * 11, 10), "文本有 11 个字符，上限为 10"),
                       (lambda: check_seed("x"), "随机种子必须是 0 到 2147483647 之间的整数")):
        with pytest.raises(InputError) as e:
            call()
        assert part in i18n.say(e.value, "zh") and i18n.say(e.value, "en") == str(e.value), str(e.value)
    with pytest.raises(NotReadyError) as e:
        StudioService(load_config()).require_ready()
    assert i18n.say(e.value, "zh") == "模型仍在加载（等待启动），请稍后再试", i18n.say(e.value, "zh")
    assert str(e.value) == "the model is still loading (waiting to start); try again in a moment"
    assert i18n.say(ValueError("Something new."), "zh") == "Something new."  # unknown: unchanged
    assert i18n.say("Type the text to speak.", "zh") == "Type the text to speak."  # plain text: no key


def test_an_upload_refusal_speaks_the_pages_language(tmp_path, monkeypatch):
    from app.ui import handlers

    shown = []
    monkeypatch.setattr(handlers.gr, "Warning", lambda message, title: shown.append((title, message)))
    fake = tmp_path / "notes.wav"
    fake.write_text("these are my notes, not a recording\n")
    zh_page = SimpleNamespace(headers={"accept-language": "zh-CN,zh;q=0.9"})
    check = handlers.Handlers.check_upload
    assert check(str(fake), zh_page) is None and check(str(fake)) is None  # refused and cleared
    (zh_title, zh), (en_title, en) = shown
    assert zh_title == "不是音频文件" and zh.startswith("notes.wav 不是可读取的音频文件"), zh
    assert en_title == "Not an audio file" and en.startswith("notes.wav: not a readable audio file"), en


def test_lang_of_request():
    def req(accept: str | None = None):
        return SimpleNamespace(headers={"accept-language": accept} if accept else {})

    assert i18n.lang_of(None) == i18n.lang_of(req()) == "en"  # API clients
    assert i18n.lang_of(req("zh-CN,zh;q=0.9")) == i18n.lang_of(req("zh")) == "zh"  # a Chinese browser
    assert i18n.lang_of(req("en-US,zh;q=0.8")) == i18n.lang_of(req("fr")) == "en"


def test_panel_chart_titles_follow_the_page_language():
    """A panel tick redraws the four charts with titles in the page's language (a service not started yet)."""
    from app.config import load_config
    from app.service.service import StudioService
    from app.ui.panels import refresh

    CHART_TITLES = catalog()["chart_titles"]

    service = StudioService(load_config())
    for lang in ("en", "zh"):
        _, memory, load, stages, latency, *_ = refresh(service, lang)
        titles = CHART_TITLES[lang]
        assert (memory.title, load.title, stages.title, latency.title) == (
            titles["ram"], titles["load"], titles["stages"], titles["latency"])
    en, zh = CHART_TITLES["en"], CHART_TITLES["zh"]
    assert set(en) == set(zh) and all(en[k] != zh[k] for k in en)


def test_panels_speak_the_pages_language():
    """A panel tick in Chinese: the headline, the engine facts, the axes, the legends and the latency table (a
    stopped request's row too); in English the same panels as the tests and docs read them."""
    from app.config import load_config
    from app.engine.requests import RequestStats
    from app.service.service import StudioService
    from app.ui.panels import refresh

    service = StudioService(load_config())
    stats = RequestStats(ttfa_ms=120.0, wall_s=2.0, audio_s=1.5, n_tokens=40, n_segments=1, n_chunks=3, lm_s=0.5,
                         flow_s=0.4, hift_s=0.3)
    service.metrics.request_started()
    service.metrics.request_finished(stats, 0.1, "cancelled", stopped=True)
    en = refresh(service, "en")
    zh = refresh(service, "zh")
    headline, memory, load, stages, latency, table, facts = zh
    english = re.compile(r"\b(?:active|streams|cores|used|status|requests|produced|fact|value|waiting)\b")
    assert not english.search(headline) and not english.search(facts), (headline, facts)
    assert "活动流 **0**" in headline and "首音延迟 p50 120 毫秒" in headline and "等待启动" in headline, headline
    assert "| 项目 |" in facts and "| 状态 | `等待启动` |" in facts and "已取消 1" in facts, facts
    assert (memory.x_title, load.x_title, stages.x_title, latency.x_title) == ("秒前", "秒前", "请求序号", "请求序号")
    assert (load.y_title, stages.y_title, latency.y_title) == ("百分比", "秒", "数值")
    assert (memory.color_title, stages.color_title) == ("序列", "阶段")  # the legends' titles
    assert set(stages.value["data"][i][2] for i in range(4)) == {"排队", "LM", "flow", "声码器"}
    assert all(CJK.search(row[2]) for row in latency.value["data"]), latency.value["data"]
    assert list(table.columns)[2:5] == ["结束于", "结果", "首音延迟 ms"] and table.iloc[0]["结果"] == "已停止"
    headline, memory, _, stages, _, table, facts = en
    assert "active streams **0**" in headline and "TTFA p50 120 ms" in headline and "| fact | value |" in facts
    assert (memory.x_title, stages.x_title, memory.y_title) == ("seconds ago", "request #", "MiB")
    assert table.iloc[0]["outcome"] == "stopped" and table.iloc[0]["TTFA ms"] == "120"


def test_panel_legends_stay_categories_in_both_languages():
    """The charts' colour fields are categories on every tick, also before any request: an empty legend column
    that turned numeric made the browser draw a "NaN" gradient legend and no bars, even once requests came."""
    from app.config import load_config
    from app.engine.requests import RequestStats
    from app.service.service import StudioService
    from app.ui.panels import refresh

    service = StudioService(load_config())
    stats = RequestStats(ttfa_ms=120.0, wall_s=2.0, audio_s=1.5, n_tokens=40, n_segments=1, n_chunks=3, lm_s=0.5,
                         flow_s=0.4, hift_s=0.3)
    for finished in (False, True):
        if finished:
            service.metrics.request_started()
            service.metrics.request_finished(stats, 0.1, "ok")
        for lang in ("en", "zh"):
            _, memory, load, stages, latency, *_ = refresh(service, lang)
            for plot, color in ((memory, "series"), (load, "series"), (stages, "stage"), (latency, "series")):
                assert plot.value["datatypes"][color] == "nominal", (lang, finished, plot.value["datatypes"])
            assert len(stages.value["data"]) == (4 if finished else 0)


def test_presets_fill_a_valid_instruction():
    choices = preset_choices()
    assert choices[0][1] == "" and len(choices) == len(PRESETS) + 1
    instructions = [v for _, v in PRESETS]
    assert "用粤语说这句话" in instructions and "用四川话说这句话" in instructions
    assert any("语气" in v for v in instructions) and any("语速" in v for v in instructions)  # emotions, speed
    for label, value in PRESETS:
        # the pipeline takes each as it is
        assert check_instruct(value, "instruct", LimitsConfig().max_instruct_chars) == value, label
        assert apply_preset(value, "typed before") == value
    assert apply_preset("", "typed before") == "typed before"


def test_tag_help_names_tags_the_tokenizer_knows():
    for lang in (i18n.labels("en"), i18n.labels("zh")):
        tags = set(re.findall(r"\[[a-z_]+\]|</?[a-z]+>", lang["tags_help"]))
        assert {"[laughter]", "[breath]", "<strong>", "</strong>"} <= tags
        assert tags <= set(SPECIAL_TOKENS), tags - set(SPECIAL_TOKENS)


@pytest.mark.slow
def test_a_chinese_browser_gets_the_chinese_page_transcribes_and_presets(studio_asr):
    """A browser whose language is Chinese gets the page in Chinese: Gradio's labels (gr.I18n), the server's lines
    (its Accept-Language) and the page player's. On conftest.py's server with the rigged Whisper (shared with
    test_asr.py)."""
    _need(Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing")
    _need(shutil.which("ffmpeg") is not None, "ffmpeg is missing")
    _need(importlib.util.find_spec("playwright") is not None, "the playwright package is missing")
    from playwright.sync_api import sync_playwright

    url, _ = studio_asr
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[*CHROMIUM_ARGS, "--lang=zh-CN"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000}, locale="zh-CN")
            page.goto(url)
            page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('状态')",
                                   timeout=60_000)
            page.wait_for_function("() => document.querySelector('#go')?.innerText.trim() === '生成'", timeout=10_000)
            # the live panels' lines too
            page.wait_for_function("() => (document.querySelector('#panel_headline')?.innerText || '')"
                                   ".includes('活动流')", timeout=30_000)
            body = page.locator("body").inner_text()
            for zh in ("停止", "要朗读的文本", "参考录音的文字稿", "识别文字", "文本中的标记", "引擎实时面板",
                       "英文，零样本", "授权声明", "低延迟播放器：就绪"):  # (the banner too: the tiny model is random)
                assert zh in body, zh

            # Transcribe fills the transcript box
            page.locator("#prompt_audio input[type=file]").set_input_files(str(EXAMPLE_WAV))
            page.wait_for_selector("#prompt_audio audio, #prompt_audio [data-testid='waveform-prompt_audio']",
                                   state="attached", timeout=30_000)
            page.locator("#transcribe").click()
            page.wait_for_function(f"() => document.querySelector('#prompt_text textarea').value"
                                   f".includes('{RIGGED_WORD}')", timeout=120_000)
            assert "已自动识别参考录音" in page.locator("body").inner_text()  # the toast, in Chinese

            # instruct presets: visible in instruct mode, the pick fills the instruction box
            assert not page.locator("#preset").is_visible()
            page.locator("#mode").get_by_label("指令控制").check()
            page.locator("#preset input").click()
            page.get_by_role("option", name="Cantonese · 粤语").click()
            page.wait_for_function("() => document.querySelector('#instruct_text textarea')?.value"
                                   " === '用粤语说这句话'", timeout=10_000)

            # a blank transcript at Generate (zero-shot) is filled in for correction
            page.locator("#mode").get_by_label("零样本克隆").check()
            page.locator("#prompt_text textarea").fill("")
            page.locator("#text textarea").fill("Hello from the language test.")
            t0 = time.perf_counter()
            page.locator("#go").click()
            page.wait_for_function(f"() => document.querySelector('#prompt_text textarea').value"
                                   f".includes('{RIGGED_WORD}')", timeout=120_000)
            print(f"transcript filled {time.perf_counter() - t0:.1f} s after Generate")
            # the low-latency player's line, in Chinese when the take ends
            page.wait_for_function("() => document.getElementById('studio_player_line')?.textContent"
                                   ".includes('首个声音')", timeout=120_000)
            page.wait_for_function("() => document.getElementById('studio_player_line')?.textContent"
                                   ".startsWith('✔')", timeout=120_000)
            # the take's stats line and the live panels, in Chinese too
            page.wait_for_function("() => (document.getElementById('stats')?.textContent || '')"
                                   ".includes('首音延迟')", timeout=30_000)
            page.wait_for_function("() => (document.querySelector('#panel_headline')?.innerText || '')"
                                   ".includes('活动流')", timeout=30_000)
            player_stats = page.locator("#stats").inner_text()
            assert "种子" in player_stats and "低延迟" in player_stats and "TTFA" not in player_stats, player_stats
            # one unit spelling (the server's part says 毫秒, the page's player's part too) and the mode's name
            player_line = page.locator("#studio_player_line").inner_text()
            for line in (player_stats, player_line):
                assert "毫秒" in line and not re.search(r"\bms\b", line), line
            assert "模式 零样本克隆" in player_stats and "zero_shot" not in player_stats, player_stats
            assert "结果" in page.locator("#latency_table").inner_text()  # the table's columns
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
        finally:
            browser.close()


def test_handlers_speak_the_pages_language():
    """A handler takes the page's request (Gradio injects it, it is no input) and says its lines and refusals in
    the page's language; an API client (no request) reads English."""
    import inspect

    import gradio as gr

    from app.ui.handlers import Handlers

    zh_request = SimpleNamespace(headers={"accept-language": "zh-CN,zh;q=0.9"})
    deleted = []
    store = SimpleNamespace(delete=deleted.append)
    h = Handlers(SimpleNamespace(cfg=None, voices=SimpleNamespace(of=lambda owner, of=None: store)))
    assert list(inspect.signature(h.delete_voice).parameters) == ["voice", "request", "profile"]
    assert h.delete_voice("bob", zh_request) == ("已删除声音 **bob**。", "")
    assert h.delete_voice("bob") == ("Deleted voice **bob**.", "") and deleted == ["bob", "bob"]  # API clients
    with pytest.raises(gr.Error) as e:
        h.delete_voice("", zh_request)
    assert (e.value.message, e.value.title) == ("请选择要删除的已保存声音。", "错误")
    assert "微型随机模型" in i18n.t("zh", "banner", repo="FunAudioLLM/CosyVoice2-0.5B")
