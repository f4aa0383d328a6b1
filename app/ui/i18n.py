"""Interface labels in English and Chinese (Gradio picks the browser's language; English otherwise).

Only static labels live here; dynamic lines (status, stats, errors) are English, as the API's.
"""

from __future__ import annotations

import gradio as gr

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
    "prompt_text_info": "Exactly what is said in the recording. Empty: cross-lingual mode (the voice without "
                        "its words).",
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
    "prompt_text_info": "录音中所说的原文。留空则使用跨语种模式（只用音色，不用文字）。",
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
}

def make_i18n(extra: dict[str, dict[str, str]] | None = None) -> gr.I18n:
    """The studio's `gr.I18n`, with `extra` translations (e.g. the panels' labels) merged in."""
    en, zh = dict(EN), dict(ZH)
    for lang, table in (extra or {}).items():
        {"en": en, "zh": zh}.get(lang, {}).update(table)
    return gr.I18n(en=en, zh=zh)
