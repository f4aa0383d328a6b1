/* The standard player's `synthesize` failed (app/ui/layout.py): Gradio shows its pop-up, and the handler put
   the same message into the details (app/ui/handlers.py): it goes next to Generate, the details are cleared. */
(details) => {
  const p = window.studioPlayer;
  if (p) {
    p.setBusy(false);
    p.showError((details && details.error) || 'The request failed.', false);
  }
  return [null];
}
