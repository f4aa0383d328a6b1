/* The standard player's `synthesize` failed (app/ui/layout.py): Gradio shows its pop-up; its message also
   goes next to Generate. */
() => {
  const p = window.studioPlayer;
  if (p) p.setBusy(false);
  setTimeout(() => {
    const toasts = [...document.querySelectorAll('.toast-body')].filter((t) => /error/i.test(t.className));
    const last = toasts.length ? toasts[toasts.length - 1] : null;
    const body = last ? last.querySelector('.toast-message-text, .toast-text') : null;
    const text = body ? body.innerText.trim() : (last ? last.innerText.replace(/^\s*Error\s*×?\s*/, '').trim()
                                                      : 'The request failed.');
    if (p) p.showError(text, false);
  }, 300);  // once the pop-up is drawn
  return [];
}
