"""The page's words in English and Chinese: labels (`gr.I18n`), and the messages handlers return.

Labels follow Gradio's locale: the browser's language at first, then the page's own switch (app/ui/lang_switch.py
sets Gradio's locale and a `studio_lang` cookie; Gradio's footer settings change the labels only). Messages
the server writes (status, banner, errors, notes) follow `lang_of(request)`: the cookie, else the
browser's Accept-Language; API clients send neither and get English. `translate` turns an English
message of the engine (app/engine/inputs.py, prepare.py, ...) into Chinese by the patterns in
`MESSAGES_ZH`; one it does not know stays English, behind a Chinese "错误" title.
"""

from __future__ import annotations

import functools
import inspect
import re
import typing
from collections.abc import Callable
from typing import Any

import gradio as gr

LANG_COOKIE = "studio_lang"
LANGS = ("en", "zh")
EN = {
    "intro": "Give a text and a short reference recording (3-10 s) with its transcript: the text is spoken in "
             "that voice. With **Stream** on, audio plays while it is generated.",
    "consent": "**Consent:** only clone a voice you own or have the speaker's explicit permission to use. "
               "Do not use cloned voices to deceive or impersonate anyone.",
    "text": "Text to speak",
    "text_placeholder": "Type what the cloned voice should say...",
    "reference": "Reference voice",
    "prompt_audio": "Reference recording (upload or record, up to 30 s)",
    "prompt_text": "Transcript of the reference",
    "prompt_text_info": "Exactly what is said in the recording. Empty: transcribed automatically (Whisper) "
                        "at Generate or Save, or with the Transcribe button; without Whisper, cross-lingual mode "
                        "(the voice without its words).",
    "mode": "Mode",
    "mode_zero_shot": "Zero-shot clone",
    "mode_cross_lingual": "Cross-lingual",
    "mode_instruct": "Instruct",
    "instruct_text": "Instruction",
    "instruct_placeholder": "e.g. Speak slowly and calmly.",
    "saved_voices": "Saved voices",
    "voice": "Saved voice (used instead of the recording when set)",
    "voice_name": "Save the current reference as",
    "save_voice": "Save voice",
    "replace_voice": "Replace a saved voice of that name",
    "delete_voice": "Delete selected voice",
    "seed": "Seed (-1 = random)",
    "random_seed": "🎲 Random seed",
    "speed": "Speed (only without streaming)",
    "stream": "Stream (play while generating)",
    "player": "Player",
    "player_info": "Low-latency plays the audio as it arrives (WebAudio); standard is Gradio's streamed player.",
    "player_webaudio": "low-latency (WebAudio)",
    "player_gradio": "standard (Gradio)",
    "generate": "Generate",
    "stop": "Stop",
    "stream_out": "Live audio",
    "final_out": "Final WAV (download)",
    "details": "Request details",
    "examples": "Examples (reference recordings made with espeak-ng)",
    "panels": "Live engine panels",
    "lang": "Language / 语言",
    "transcribe": "📝 Transcribe",
    "preset": "Instruction presets",
    "preset_info": "Picks an instruction (CosyVoice2 follows Chinese instructions best); edit it as you like.",
    "tags_help": "**Tags in the text:** `[laughter]` a laugh, `[breath]` a breath (also `[quick_breath]`, `[sigh]`, "
                 "`[cough]`, `[noise]`); `<strong>word</strong>` stresses a word; `<laughter>words</laughter>` "
                 "says the words laughing. Example: `That is so funny [laughter], I <strong>love</strong> it.`",
    "ex_en": "English, zero-shot",
    "ex_zh": "中文, zero-shot",
    "ex_numbers": "numbers and dates",
    "ex_cross": "English voice speaks Chinese",
    "ex_instruct": "instruct",
}

ZH = {
    "intro": "输入文本和一段简短的参考录音（3-10 秒）及其文字稿：文本将以该声音朗读。"
             "开启 **流式** 后，音频边生成边播放。",
    "consent": "**授权声明：** 只克隆你本人或已获说话人明确许可的声音。不得利用克隆声音欺骗或冒充他人。",
    "text": "要朗读的文本",
    "text_placeholder": "输入克隆声音要说的话……",
    "reference": "参考声音",
    "prompt_audio": "参考录音（上传或录制，最长 30 秒）",
    "prompt_text": "参考录音的文字稿",
    "prompt_text_info": "录音中所说的原文。留空时在生成或保存时（或点击“识别文字”）由 Whisper 自动识别；"
                        "没有 Whisper 时使用跨语种模式（只用音色，不用文字）。",
    "mode": "模式",
    "mode_zero_shot": "零样本克隆",
    "mode_cross_lingual": "跨语种",
    "mode_instruct": "指令控制",
    "instruct_text": "指令",
    "instruct_placeholder": "例如：用缓慢平静的语气说",
    "saved_voices": "已保存的声音",
    "voice": "已保存的声音（选中时代替参考录音）",
    "voice_name": "将当前参考保存为",
    "save_voice": "保存声音",
    "replace_voice": "覆盖同名的已保存声音",
    "delete_voice": "删除所选声音",
    "seed": "随机种子（-1 为随机）",
    "random_seed": "🎲 随机种子",
    "speed": "语速（仅非流式）",
    "stream": "流式（边生成边播放）",
    "player": "播放器",
    "player_info": "低延迟：音频一到就播放（WebAudio）；标准：Gradio 的流式播放器。",
    "player_webaudio": "低延迟（WebAudio）",
    "player_gradio": "标准（Gradio）",
    "generate": "生成",
    "stop": "停止",
    "stream_out": "实时音频",
    "final_out": "完整 WAV（下载）",
    "details": "请求详情",
    "examples": "示例（参考录音由 espeak-ng 生成）",
    "panels": "引擎实时面板",
    "lang": "Language / 语言",
    "transcribe": "📝 识别文字",
    "preset": "指令预设",
    "preset_info": "选择一条指令（CosyVoice2 最擅长中文指令），可再修改。",
    "tags_help": "**文本中的标记：** `[laughter]` 笑声，`[breath]` 呼吸声（还有 `[quick_breath]`、`[sigh]`、`[cough]`、"
                 "`[noise]`）；`<strong>词</strong>` 重读该词；`<laughter>文字</laughter>` 笑着说出这些文字。"
                 "例如：`这太好笑了[laughter]，我<strong>非常</strong>喜欢。`",
    "ex_en": "英文，零样本",
    "ex_zh": "中文，零样本",
    "ex_numbers": "数字和日期",
    "ex_cross": "英文声音说中文",
    "ex_instruct": "指令控制",
}

EXAMPLE_KEYS = ("ex_en", "ex_zh", "ex_numbers", "ex_cross", "ex_instruct")


def make_i18n(extra: dict[str, dict[str, str]] | None = None) -> gr.I18n:
    """The studio's `gr.I18n`, with `extra` translations (e.g. the panels' labels) merged in."""
    en, zh = dict(EN), dict(ZH)
    for lang, table in (extra or {}).items():
        {"en": en, "zh": zh}.get(lang, {}).update(table)
    return gr.I18n(en=en, zh=zh)


# --- messages the server writes (English = the API's words) ------------------------------------------

MESSAGES = {  # key -> (English, Chinese) with str.format fields
    "status_ready": ("**Status:** ready · backend `{backend}` · device `{device}` · model `{model}`",
                     "**状态：** 就绪 · 后端 `{backend}` · 设备 `{device}` · 模型 `{model}`"),
    "status_failed": ("**Status:** failed to start: {error}", "**状态：** 启动失败：{error}"),
    "status_loading": ("**Status:** {status}…  (synthesis is available once the model is ready)",
                       "**状态：** {status}…（模型就绪后即可合成）"),
    "no_ffmpeg": ("ffmpeg is not installed: live playback is off (the final WAV still plays).",
                  "未安装 ffmpeg：实时播放已关闭（完整 WAV 仍可播放）。"),
    "banner": ("### ⚠️ Running on a generated tiny random model: the output is noise\n"
               "No model folder was given and `{repo}` could not be downloaded. Point the app at real weights with "
               "`python app.py --model-dir /path/to/CosyVoice2-0.5B` (or `COSYVOICE_MODEL_DIR`), or start it with "
               "internet access to download them.",
               "### ⚠️ 正在使用生成的微型随机模型：输出只是噪声\n"
               "未指定模型文件夹，且无法下载 `{repo}`。请用 `python app.py --model-dir /path/to/CosyVoice2-0.5B`"
               "（或 `COSYVOICE_MODEL_DIR`）指向真实权重，或在联网时启动以下载权重。"),
    "transcribed": ("Transcribed the reference ({language}): check the transcript box and correct it if needed.",
                    "已自动识别参考录音（{language}）：请检查文字稿框，必要时修改。"),
    "transcribing": ("Transcribing the reference…", "正在识别参考录音……"),
    "downloading": ("Downloading {model}: {done:.2f} / {total:.2f} GB",
                    "正在下载 {model}：{done:.2f} / {total:.2f} GB"),
    "need_audio": ("Upload or record the reference clip first.", "请先上传或录制参考录音。"),
    "error": ("Error", "错误"),
}
TITLES_ZH = {"Error": "错误", "Not ready": "未就绪", "Busy": "繁忙", "Name taken": "名称已被使用",
             "Not an audio file": "不是音频文件", "Malformed request": "请求格式错误"}

# English message (a regex of the engine's words) -> Chinese (groups by number); first match wins. The page's
# translator (app/ui/lang_switch.py) runs them in the browser too: JavaScript regex syntax only
MESSAGES_ZH: list[tuple[re.Pattern[str], str]] = [(re.compile(p, re.S), zh) for p, zh in (
    # the stats line (handlers.stats_line; the low-latency player's text goes on after "seed N")
    (r"TTFA (\S+) ms · RTF (\S+) · (\S+) tokens/s · audio (\S+) s · LM (\S+) s · flow (\S+) s · vocoder (\S+) s · "
     r"queue (\S+) s · reference (\S+) s · mode (\w+) · seed (-?\d+)(.*)",
     r"首音延迟 \1 毫秒 · 实时率 \2 · \3 词元/秒 · 音频 \4 秒 · LM \5 秒 · flow \6 秒 · 声码器 \7 秒 · "
     r"排队 \8 秒 · 参考音频 \9 秒 · 模式 \10 · 种子 \11\12"),
    (r"Stopped: kept ([\d.]+) s of audio · mode (\w+) · seed (-?\d+)", r"已停止：保留了 \1 秒音频 · 模式 \2 · 种子 \3"),
    (r"Stopped: kept ([\d.]+) s of audio · seed (-?\d+)", r"已停止：保留了 \1 秒音频 · 种子 \2"),  # player.js
    (r"Stopped: kept ([\d.]+) s of audio", r"已停止：保留了 \1 秒音频"),
    (r"Stopped before it started\.", "在开始前已停止。"),
    (r"streaming… ([\d.]+) s", r"流式生成中… \1 秒"),
    (r"ffmpeg is not installed: live playback is off, the final WAV plays when done",
     "未安装 ffmpeg：实时播放已关闭，生成完后播放完整 WAV"),
    (r"the model is still loading \((.*)\); try again in a moment", r"模型仍在加载（\1），请稍后再试"),
    (r"the model failed to start: (.*)", r"模型启动失败：\1"),
    (r"Upload or record a reference clip, or pick a saved voice\.", "请上传或录制参考录音，或选择已保存的声音。"),
    (r"Upload or record the reference clip to save first\.", "请先上传或录制要保存的参考录音。"),
    (r"Type the text to speak.*", "请输入要朗读的文本（当前为空，或只有控制字符/特殊标记）。"),
    (r"The text has (\d+) characters; the limit is (\d+).*", r"文本有 \1 个字符，上限为 \2。请缩短或分段。"),
    (r"The text has nothing speakable.*", "文本中没有可朗读的内容（只有标点、符号或表情）：请输入文字。"),
    (r"Instruct mode needs an instruction.*", "指令模式需要一条指令，例如“用缓慢平静的语气说”。"),
    (r"Speed works only without streaming.*", "语速只能在非流式下调整：请关闭流式或把语速设为 1.0。"),
    (r"The seed must be an integer.*", "随机种子必须是 0 到 2147483647 之间的整数（-1 为随机）。"),
    (r"no saved voice (.*?); pick a saved voice.*", r"没有已保存的声音 \1：请选择已保存的声音或上传参考录音"),
    (r"(.*) is only ([\d.]+) s long.*", r"\1 只有 \2 秒：参考录音至少需要 1 秒（3-10 秒最佳）。"),
    (r"(.*) is silent.*", r"\1 是静音：请上传有人声的录音。"),
    # the decoder's words (app/audio.py AudioError): "<file name>: ..."
    (r"([^:]*): not a readable audio file.*", r"\1 不是可读取的音频文件：请上传 WAV、FLAC、OGG 或 MP3 录音。"),
    (r"([^:]*): no audio stream", r"\1 中没有音频流：请上传 WAV、FLAC、OGG 或 MP3 录音。"),
    (r"([^:]*): the audio stream holds no samples", r"\1 的音频流是空的：请上传有声音的录音。"),
    (r"([^:]*): decoding this (.*) audio took over (\d+) s.*", r"\1：解码这段 \2 音频超过 \3 秒：请转换为 WAV。"),
    (r"([^:]*): (.*) audio is not supported without ffmpeg.*",
     r"\1：没有 ffmpeg 时不支持 \2 音频：请安装 ffmpeg 或 PyAV（`pip install av`），或转换为 WAV。"),
    (r"([^:]*): cannot decode audio.*", r"\1 无法解码：请转换为 WAV、FLAC、OGG 或 MP3。"),
    (r"([^:]*): this (.*) audio cannot be decoded.*", r"\1：这段 \2 音频无法解码：请转换为 WAV、FLAC、OGG 或 MP3。"),
    (r"audio file not found: (.*)", r"找不到音频文件：\1"),
    (r"(.*?)(?: is)? not (?:an? )?audio.*|(.*) cannot be decoded.*",
     r"\1\2 不是可识别的音频：请转换为 WAV、FLAC、OGG 或 MP3。"),
    (r"Pick a saved voice to delete\.", "请选择要删除的已保存声音。"),
    (r"invalid voice name.*", "声音名称无效：只能用 1-64 个字母、数字、_ 或 -。"),
    (r".*exists already.*", "同名声音已存在：勾选“覆盖同名的已保存声音”以覆盖。"),
    (r"Saved voice \*\*(.*?)\*\* \(([\d.]+) s\) \(no transcript: it will speak in cross-lingual mode\)\.(.*)",
     r"已保存声音 **\1**（\2 秒）（没有文字稿：将以跨语种模式朗读）。\3"),
    (r"Saved voice \*\*(.*?)\*\* \(([\d.]+) s\)\.(.*)", r"已保存声音 **\1**（\2 秒）。\3"),
    (r"Saved voice \*\*(.*?)\*\* \(([\d.]+) s\)(.*)", r"已保存声音 **\1**（\2 秒）\3"),
    (r"Deleted voice \*\*(.*?)\*\*\.", r"已删除声音 **\1**。"),
    (r"transcribed the reference \((\w+)\): \"(.*)\" \(type the transcript to correct it\)",
     r"已自动识别参考录音（\1）：“\2”（可在文字稿中修改）"),
    (r"Whisper heard no words in the reference: type its transcript", "Whisper 未在参考录音中听到文字：请输入文字稿"),
    (r"automatic transcription is unavailable: (.*)", r"无法自动识别文字：\1"),
    (r"automatic transcription is off.*", "自动识别文字已关闭（[asr] enabled = false）"),
    (r"the reference could not be transcribed: (.*)", r"参考录音无法识别：\1"),
    (r"no transcript: used cross-lingual mode.*", "没有文字稿：已使用跨语种模式（只用音色，不用文字）"),
    (r"the reference clip is ([\d.]+) s, over the (\d+) s limit.*",
     r"参考录音长 \1 秒，超过 \2 秒上限：已截取最响的一段。"),
    (r"the reference clip is heavily clipped.*", "参考录音严重削波：克隆的声音可能失真。"),
    (r"This application is currently busy.*|.*server is busy.*", "服务器繁忙，请稍后再试。"),
    (r"Synthesis failed: (.*)", r"合成失败：\1"),
)]


# the service's status (StudioService.status, app/model/source.py) -> Chinese; the panels and the status line show it
STATUS_ZH: list[tuple[re.Pattern[str], str]] = [(re.compile(p, re.S), zh) for p, zh in (
    (r"waiting to start", "等待启动"), (r"loading model", "正在加载模型"), (r"starting engine", "正在启动引擎"),
    (r"warming up", "正在预热"), (r"ready", "就绪"), (r"stopped", "已停止"),
    (r"looking for (.*) \(cache, then the Hugging Face Hub\)", r"正在查找 \1（先查本地缓存，再查 Hugging Face Hub）"),
    (r"downloading (.*): ([\d.]+) / ([\d.]+) GB", r"正在下载 \1：\2 / \3 GB"),
    (r"generating a tiny random model.*", "正在生成微型随机模型（没有可用的权重：输出将是噪声）"),
    (r"error: (.*)", r"出错：\1"),
)]


def status_text(status: str, lang: str) -> str:
    """The service's status in `lang` (unchanged for English or a status no pattern knows)."""
    if lang == "zh":
        for pattern, zh in STATUS_ZH:
            if m := pattern.fullmatch(status.strip()):
                return m.expand(zh)
    return status


def title_in(title: str, lang: str) -> str:
    """A pop-up's title ("Busy", "Not ready", ...) in `lang`."""
    return TITLES_ZH.get(title, title) if lang == "zh" else title


def lang_of(request: Any) -> str:
    """The page's language for `request` (a gr.Request or None): the switch's cookie, else Accept-Language."""
    if request is None:
        return "en"
    cookies = getattr(request, "cookies", None) or {}
    if cookies.get(LANG_COOKIE) in LANGS:
        return cookies[LANG_COOKIE]
    accept = (getattr(request, "headers", None) or {}).get("accept-language", "")
    return "zh" if accept.lower().lstrip().startswith("zh") else "en"


def t(lang: str, key: str, **fields: Any) -> str:
    """The message `key` in `lang`, its fields filled in."""
    en, zh = MESSAGES[key]
    return (zh if lang == "zh" else en).format(**fields)


def translate(message: str, lang: str) -> str:
    """An English message from the engine in `lang` (unchanged for English or a message no pattern knows)."""
    if lang != "zh":
        return message
    for pattern, zh in MESSAGES_ZH:
        if m := pattern.fullmatch(message.strip()):
            return m.expand(zh)
    return message


def error(message: str, lang: str, **kw: Any) -> gr.Error:
    """A gr.Error with the message in `lang` (the title too, unless given)."""
    kw.setdefault("title", t(lang, "error"))
    return gr.Error(translate(message, lang), print_exception=False, **kw)


def localized(fn: Callable) -> Callable:
    """Handler `fn` (sync, async or an async generator) whose gr.Error and returned messages are in the page's
    language: Gradio passes the wrapper a gr.Request (appended to `fn`'s parameters unless it has one)."""
    sig = inspect.signature(fn)
    own = "request" in sig.parameters
    params = list(sig.parameters.values())
    if not own:
        params.append(inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                        annotation=gr.Request))

    def split(args: tuple, kwargs: dict) -> tuple[tuple, dict, str]:
        bound = inspect.Signature(params).bind(*args, **kwargs)
        request = bound.arguments.get("request")
        if not own:
            bound.arguments.pop("request", None)
        return bound.args, bound.kwargs, lang_of(request)

    def relabel(e: gr.Error, lang: str) -> gr.Error:
        return gr.Error(translate(e.message, lang), title=title_in(e.title, lang), print_exception=False)

    def out(value: Any, lang: str) -> Any:
        if isinstance(value, str):
            return translate(value, lang)
        return tuple(out(v, lang) for v in value) if isinstance(value, tuple) else value

    if inspect.isasyncgenfunction(fn):
        async def wrapper(*args: Any, **kwargs: Any):
            args, kwargs, lang = split(args, kwargs)
            try:
                async for item in fn(*args, **kwargs):
                    yield item
            except gr.Error as e:
                raise relabel(e, lang) from e
    elif inspect.iscoroutinefunction(fn):
        async def wrapper(*args: Any, **kwargs: Any):
            args, kwargs, lang = split(args, kwargs)
            try:
                return out(await fn(*args, **kwargs), lang)
            except gr.Error as e:
                raise relabel(e, lang) from e
    else:
        def wrapper(*args: Any, **kwargs: Any):
            args, kwargs, lang = split(args, kwargs)
            try:
                return out(fn(*args, **kwargs), lang)
            except gr.Error as e:
                raise relabel(e, lang) from e
    functools.update_wrapper(wrapper, fn)
    del wrapper.__wrapped__  # Gradio reads the signature below, not fn's
    wrapper.__signature__ = sig.replace(parameters=params)
    try:  # resolved here: the wrapper's module cannot resolve fn's string annotations
        hints = typing.get_type_hints(fn)
    except (NameError, TypeError):
        hints = {}
    wrapper.__annotations__ = {**hints, "request": gr.Request}
    return wrapper
