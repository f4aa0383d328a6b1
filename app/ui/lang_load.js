/* demo.load's JS (app/ui/lang_switch.py): defines window.studioI18n.apply(lang), which puts IDS' texts (what
   the page's own players write; the server says its own lines in the page's language) in `lang`: PHRASES
   swapped and UNITS after numbers, kept so while the players rewrite them (one observer per element, not the
   body); then a language chosen earlier (its cookie) is applied again, and the switch set. */
() => {
  (() => {
    const PHRASES = __PHRASES__, IDS = __IDS__;
    const UNITS = __UNITS__.map(([en, cn]) => [new RegExp('(\\d) ' + en + '\\b', 'g'), '$1 ' + cn]);
    const phrases = (text) => {
      for (const [en, cn] of PHRASES) text = text.split(en).join(cn);
      for (const [re, r] of UNITS) text = text.replace(re, r);
      return text;
    };
    const self = window.studioI18n = window.studioI18n || {lang: 'en', watched: new Set()};
    const orig = new WeakMap();  // text node -> [its English, what we wrote]
    const fixNode = (n) => {
      const v = n.nodeValue, rec = orig.get(n);
      if (self.lang === 'zh') {
        if (rec && v === rec[1]) return;  // ours
        const out = phrases(v);
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
      document.dispatchEvent(new CustomEvent('studio-lang', {detail: lang}));  // JS-drawn parts redraw (history.js)
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
  })();
  const m = document.cookie.match(/(?:^|; )__COOKIE__=(en|zh)/);
  const lang = m ? m[1] : ((navigator.language || 'en').toLowerCase().startsWith('zh') ? 'zh' : 'en');
  if (m) (__SET_LANG__)(lang); else window.studioI18n.apply(lang);
  return lang;
}
