/* The page's language switch (app/ui/lang_switch.py), in the browser: the cookie the server reads (__COOKIE__),
   then the page's own lines (window.studioI18n, lang_load.js); returns `lang` for the server's relabel. */
(lang) => {
  if (lang !== 'en' && lang !== 'zh') return lang;
  document.cookie = '__COOKIE__=' + lang + '; path=/; max-age=31536000; SameSite=Lax';
  if (window.studioI18n?.apply) window.studioI18n.apply(lang);
  return lang;
}
