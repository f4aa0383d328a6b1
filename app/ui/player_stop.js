/* Stop (app/ui/layout.py): the low-latency player stops; the standard player's <audio> pauses now, muted,
   and may not start again until the next Generate (hls.js resumes on a late segment otherwise: player.js
   pauses it again); the page is no longer busy. */
() => {
  document.body.dataset.studioStopped = '1';
  for (const a of document.querySelectorAll('#stream_out audio')) { a.muted = true; a.pause(); }
  if (window.studioPlayer) { window.studioPlayer.stop(true); window.studioPlayer.setBusy(false); }
  return [];
}
