"""The page's language switch, in the browser: Gradio's locale, the `studio_lang` cookie, the players' lines.

`LANG_SWITCH_JS` runs when the switch is clicked; `lang_load_js()` on page load (it defines
`window.studioI18n`, which translates the lines the page's own players write, and applies a language
chosen earlier). The server side of the words is app/ui/i18n.py.
"""

from __future__ import annotations

import json
import re

from app.ui.i18n import EN, EXAMPLE_KEYS, LANG_COOKIE, MESSAGES_ZH, ZH

# the page's language switch: Gradio's locale (labels; its core module's changeLocale, the function its footer
# settings call) and the cookie the server reads; on load, a cookie chosen earlier is applied again
_SET_LANG = """async (lang) => {
  if (lang !== 'en' && lang !== 'zh') return;
  document.cookie = 'COOKIE=' + lang + '; path=/; max-age=31536000; SameSite=Lax';
  const core = performance.getEntriesByType('resource').map(e => e.name)
    .find(n => /\\/assets\\/core-[^/]+\\.js$/.test(n))
    || [...document.querySelectorAll('link[rel=modulepreload]')].map(l => l.href)
         .find(h => /core-[^/]+\\.js$/.test(h));
  if (core) (await import(core)).changeLocale(lang);
  if (window.studioI18n?.apply) window.studioI18n.apply(lang);
}""".replace("COOKIE", LANG_COOKIE)
LANG_SWITCH_JS = f"(lang) => {{ ({_SET_LANG})(lang); return lang; }}"
# the page's own players write these (app/ui/player.py, player.js); in Chinese the browser swaps them
PAGE_ZH = {
    "Low-latency player: ready (click → first byte → first sound appears here)":
        "低延迟播放器：就绪（点击 → 首字节 → 首个声音 的耗时显示在这里）",
    "Low-latency player: connecting…": "低延迟播放器：连接中…",
    "first byte": "首字节", "first sound": "首个声音", "server TTFA": "服务器首音延迟", "click": "点击",
    "Stopped": "已停止", "s of audio": "秒音频", "underruns": "次欠载", "⏸ Pause": "⏸ 暂停",
    "▶ Resume": "▶ 继续", "Final WAV": "完整 WAV", "⏳ Generating…": "⏳ 生成中…",
    " · player": " · 播放器", "low-latency": "低延迟",  # the low-latency player's stats: "... · player low-latency"
    **{EN[k]: ZH[k] for k in EXAMPLE_KEYS},  # gr.Examples' labels: Gradio does not translate them
}
PAGE_IDS = ("studio_player_line", "studio_busy", "studio_error", "player_pause", "player_final_label", "player_stats",
            "stats", "examples")


def page_translator_js() -> str:
    """JS defining `window.studioI18n.apply(lang)`: PAGE_IDS' texts in `lang` (phrases of PAGE_ZH, errors by
    MESSAGES_ZH's patterns), kept so while the players rewrite them (one observer per element, not the body)."""
    patterns = [[p.pattern, re.sub(r"\\(\d)", r"$\1", zh)] for p, zh in MESSAGES_ZH]
    phrases = sorted(PAGE_ZH.items(), key=lambda kv: -len(kv[0]))  # longest first
    return """
(() => {
  const PHRASES = __PHRASES__, IDS = __IDS__;
  const PATTERNS = __PATTERNS__.map(([p, r]) => [new RegExp('^(?:' + p + ')$', 's'), r]);
  const phrases = (text) => {
    for (const [en, cn] of PHRASES) text = text.split(en).join(cn);
    return text;
  };
  const zh = (text) => {  // a pattern's English rest (e.g. after the stats line) gets the phrases too
    const t = text.trim(), pre = text.slice(0, text.indexOf(t)), post = text.slice(pre.length + t.length);
    for (const [re, r] of PATTERNS) if (re.test(t)) return pre + phrases(t.replace(re, r)) + post;
    return phrases(text);
  };
  const self = window.studioI18n = window.studioI18n || {lang: 'en', watched: new Set()};
  const orig = new WeakMap();  // text node -> [its English, what we wrote]
  const fixNode = (n) => {
    const v = n.nodeValue, rec = orig.get(n);
    if (self.lang === 'zh') {
      if (rec && v === rec[1]) return;  // ours
      const out = v.startsWith('⚠️ ') ? '⚠️ ' + zh(v.slice(3)) : zh(v);
      orig.set(n, [v, out]);
      if (out !== v) n.nodeValue = out;
    } else if (rec && v === rec[1]) {
      n.nodeValue = rec[0];
      orig.delete(n);
    }
  };
  const fix = (el) => {
    const walk = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
    for (let n = walk.nextNode(); n; n = walk.nextNode()) fixNode(n);
  };
  self.apply = (lang) => {
    self.lang = lang;
    for (const id of IDS) {
      const el = document.getElementById(id);
      if (!el) continue;
      if (!self.watched.has(id)) {
        new MutationObserver(() => fix(el)).observe(el, {childList: true, characterData: true, subtree: true});
        self.watched.add(id);
      }
      fix(el);
    }
  };
})()""".replace("__PHRASES__", json.dumps(phrases, ensure_ascii=False)).replace(
        "__PATTERNS__", json.dumps(patterns, ensure_ascii=False)).replace("__IDS__", json.dumps(PAGE_IDS))


def lang_load_js() -> str:
    """demo.load's JS: the page translator, a language chosen earlier (its cookie) applied again, the switch set."""
    return f"""() => {{
  {page_translator_js()};
  const m = document.cookie.match(/(?:^|; ){LANG_COOKIE}=(en|zh)/);
  const lang = m ? m[1] : ((navigator.language || 'en').toLowerCase().startsWith('zh') ? 'zh' : 'en');
  if (m) ({_SET_LANG})(lang); else window.studioI18n.apply(lang);
  return lang;
}}"""
