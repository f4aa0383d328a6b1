"""The page in Chinese and the instruct presets: the tables and functions, then a real browser that
switches the language, transcribes a reference (a rigged tiny Whisper, tests/tiny_whisper.py) and picks a
preset. Saves out/studio_zh.png.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from studio import EXAMPLE_WAV, run_studio
from test_browser import CHROMIUM, CHROMIUM_ARGS, _need
from tiny_whisper import RIGGED_WORD, make_tiny_whisper

from app.engine.inputs import check_instruct
from app.model.tokenizer import SPECIAL_TOKENS
from app.ui import i18n
from app.ui.presets import PRESETS, apply_preset, preset_choices

REPO = Path(__file__).resolve().parents[1]
SCREENSHOT = REPO / "out" / "studio_zh.png"
CJK = re.compile(r"[\u4e00-\u9fff]")


def test_every_label_and_message_has_chinese():
    assert set(i18n.EN) == set(i18n.ZH)
    for key in i18n.EN:
        assert CJK.search(i18n.ZH[key]) or key in ("lang",), key
    for key, (en, zh) in i18n.MESSAGES.items():
        assert CJK.search(zh) and not CJK.search(en), key
        assert re.findall(r"{(\w+)", en) == re.findall(r"{(\w+)", zh), key  # the same fields


def test_engine_messages_translate():
    zh = {m: i18n.translate(m, "zh") for m in (
        "Upload or record a reference clip, or pick a saved voice.",
        "Type the text to speak (it is empty or only control characters / special tokens).",
        "no transcript: used cross-lingual mode (the voice without its words)",
        'transcribed the reference (en): "Hello there." (type the transcript to correct it)',
        "automatic transcription is unavailable: cannot download openai/whisper-large-v3-turbo (offline)",
        "the model is still loading (warming up); try again in a moment",
    )}
    for en, got in zh.items():
        assert CJK.search(got), (en, got)
    assert "Hello there." in zh['transcribed the reference (en): "Hello there." (type the transcript to correct it)']
    assert i18n.translate("Something new.", "zh") == "Something new."  # unknown: unchanged
    assert i18n.translate("Type the text to speak.", "en") == "Type the text to speak."


def test_lang_of_request():
    def req(cookies=None, headers=None):
        return SimpleNamespace(cookies=cookies or {}, headers=headers or {})

    assert i18n.lang_of(None) == "en"  # API clients
    assert i18n.lang_of(req({i18n.LANG_COOKIE: "zh"})) == "zh"
    assert i18n.lang_of(req({i18n.LANG_COOKIE: "zh"}, {"accept-language": "en-US"})) == "zh"  # the switch wins
    assert i18n.lang_of(req(headers={"accept-language": "zh-CN,zh;q=0.9"})) == "zh"
    assert i18n.lang_of(req({i18n.LANG_COOKIE: "fr"}, {"accept-language": "en"})) == "en"


def test_panel_chart_titles_follow_the_page_language():
    """A panel tick redraws the four charts with titles in the page's language (a service not started yet)."""
    from app.config import load_config
    from app.engine.service import StudioService
    from app.ui.panels import CHART_TITLES, refresh

    service = StudioService(load_config())
    for lang in ("en", "zh"):
        _, memory, load, stages, latency, *_ = refresh(service, lang)
        titles = CHART_TITLES[lang]
        assert (memory.title, load.title, stages.title, latency.title) == (
            titles["ram"], titles["load"], titles["stages"], titles["latency"])
    en, zh = CHART_TITLES["en"], CHART_TITLES["zh"]
    assert set(en) == set(zh) and all(en[k] != zh[k] for k in en)


def test_presets_fill_a_valid_instruction():
    choices = preset_choices()
    assert choices[0][1] == "" and len(choices) == len(PRESETS) + 1
    instructions = [v for _, v in PRESETS]
    assert "用粤语说这句话" in instructions and "用四川话说这句话" in instructions
    assert any("语气" in v for v in instructions) and any("语速" in v for v in instructions)  # emotions, speed
    for label, value in PRESETS:
        assert check_instruct(value, "instruct") == value, label  # the pipeline takes each as it is
        assert apply_preset(value, "typed before") == value
    assert apply_preset("", "typed before") == "typed before"


def test_tag_help_names_tags_the_tokenizer_knows():
    for lang in (i18n.EN, i18n.ZH):
        tags = set(re.findall(r"\[[a-z_]+\]|</?[a-z]+>", lang["tags_help"]))
        assert {"[laughter]", "[breath]", "<strong>", "</strong>"} <= tags
        assert tags <= set(SPECIAL_TOKENS), tags - set(SPECIAL_TOKENS)


@pytest.mark.slow
def test_browser_switches_to_chinese_transcribes_and_presets(tiny_model_dir, tmp_path):
    _need(Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing")
    _need(shutil.which("ffmpeg") is not None, "ffmpeg is missing")
    _need(importlib.util.find_spec("playwright") is not None, "the playwright package is missing")
    from playwright.sync_api import sync_playwright

    whisper = make_tiny_whisper(tmp_path / "whisper", rigged=True)
    sets = {"asr.model_id": json.dumps(str(whisper)), "asr.device": '"cpu"', "model.download": "false"}
    with run_studio(tiny_model_dir, tmp_path, sets) as (url, _), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[*CHROMIUM_ARGS, "--lang=en-US"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000}, locale="en-US")
            page.goto(url)
            page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('ready')",
                                   timeout=60_000)
            assert page.locator("#go").inner_text().strip() == "Generate"
            page.locator("#lang").get_by_label("中文").check()
            page.wait_for_function("() => document.querySelector('#go')?.innerText.trim() === '生成'", timeout=10_000)
            page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('状态')",
                                   timeout=10_000)
            body = page.locator("body").inner_text()
            for zh in ("停止", "要朗读的文本", "参考录音的文字稿", "识别文字", "文本中的标记", "引擎实时面板",
                       "英文，零样本", "授权声明", "低延迟播放器：就绪"):  # (the banner: a real model folder here)
                assert zh in body, zh
            page.reload()  # the choice is remembered (cookie): Chinese again, labels and the server's lines
            page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('状态')",
                                   timeout=60_000)
            page.wait_for_function("() => document.querySelector('#go')?.innerText.trim() === '生成'", timeout=10_000)

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
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
            page.locator("#lang").get_by_label("English").check()  # and back
            page.wait_for_function("() => document.querySelector('#go')?.innerText.trim() === 'Generate'",
                                   timeout=10_000)
            page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('Status')",
                                   timeout=10_000)
            body = page.locator("body").inner_text()
            assert "English, zero-shot" in body and "first sound" in body and "首个声音" not in body
        finally:
            browser.close()


def test_localized_handlers_speak_the_pages_language():
    import asyncio
    import inspect

    import gradio as gr

    zh_request = SimpleNamespace(cookies={i18n.LANG_COOKIE: "zh"}, headers={})

    async def delete_voice(voice: str | None) -> tuple[str, str]:
        if not voice:
            raise gr.Error("Pick a saved voice to delete.", title="Error")
        return f"Deleted voice **{voice}**.", ""

    wrapped = i18n.localized(delete_voice)
    assert list(inspect.signature(wrapped).parameters) == ["voice", "request"]  # Gradio injects the request
    assert asyncio.run(wrapped("bob", zh_request)) == ("已删除声音 **bob**。", "")
    assert asyncio.run(wrapped("bob")) == ("Deleted voice **bob**.", "")  # API clients: English
    with pytest.raises(gr.Error) as e:
        asyncio.run(wrapped("", zh_request))
    assert (e.value.message, e.value.title) == ("请选择要删除的已保存声音。", "错误")
    assert "微型随机模型" in i18n.t("zh", "banner", repo="FunAudioLLM/CosyVoice2-0.5B")
