/* The Generate button's first event (js only; app/ui/layout.py). Gradio passes the input values in order
   (gr.Audio with type="filepath": its FileData {path, url, orig_name, ...} or null). A gate that throws
   ends the chain, so `.success(synthesize)` does not run: the page's (low-latency) player handles the
   request in the browser (its take reaches the page's outputs through its take event), its text streaming in
   when that switch is on (not for a dialogue script); with streaming off or without that player,
   `synthesize` (the standard player) runs. Either way it says which player's live part the page shows. */
(text, prompt_audio, prompt_text, mode, instruct_text, voice, seed, stream, dialogue, text_streams, feed_rate) => {
  const p = window.studioPlayer;
  if (p) { p.stop(); p.begin(); }  // the previous take's error line goes, the page is busy
  delete document.body.dataset.studioStopped;
  for (const a of document.querySelectorAll('#stream_out audio')) { a.muted = false; delete a.play; }  // Stop's
  const feeds = text_streams && !dialogue;  // text that streams in (a dialogue script is spoken whole)
  if ((!stream && !feeds) || !p) {  // streaming off (the speed applies), or a browser without the page's player
    document.body.dataset.studioResult = 'gradio';
    // what its take was asked (history.js; the rest comes with the take's details)
    const h = window.studioHistory;
    if (h) h.started({text: text || '', instruct: instruct_text || '', dialogue: !!dialogue});
    return [];
  }
  document.body.dataset.studioResult = 'webaudio';
  const params = {text: text || '', prompt_audio: prompt_audio ? (prompt_audio.path || null) : null,
                  prompt_text: prompt_text || '', mode, instruct_text: instruct_text || '', voice: voice || '',
                  seed: (seed === null || seed === '') ? null : Number(seed), dialogue: !!dialogue};
  if (feeds) p.feed(params, feed_rate);  // the words go to the WebSocket door (player_feed.js)
  else p.play(params);
  throw new Error('handled by the low-latency player');
}
