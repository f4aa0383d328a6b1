/* The page's language switch (app/ui/lang_switch.py): Gradio's locale (labels; its core module's
   changeLocale, the function its footer settings call) and the cookie the server reads (__COOKIE__), then
   the page's own lines (window.studioI18n, lang_load.js). */
async (lang) => {
  if (lang !== 'en' && lang !== 'zh') return;
  document.cookie = '__COOKIE__=' + lang + '; path=/; max-age=31536000; SameSite=Lax';
  const core = performance.getEntriesByType('resource').map(e => e.name)
    .find(n => /\/assets\/core-[^/]+\.js$/.test(n))
    || [...document.querySelectorAll('link[rel=modulepreload]')].map(l => l.href)
         .find(h => /core-[^/]+\.js$/.test(h));
  if (core) (await import(core)).changeLocale(lang);
  if (window.studioI18n?.apply) window.studioI18n.apply(lang);
}
