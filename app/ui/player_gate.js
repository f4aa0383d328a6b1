/* The Generate button's event (js only; app/ui/layout.py). Gradio passes the input values in order (gr.Audio
   with type="filepath": its FileData {path, url, orig_name, ...} or null). The page's player speaks the take
   (player.js): through studio/speech, streamed, or whole with streaming off (the speed applies); with "text
   streams in" on (not for a dialogue script) through the WebSocket door (player_feed.js). */
(text, prompt_audio, prompt_text, mode, instruct_text, voice, seed, speed, stream, dialogue, text_streams, feed_rate) => {
  const p = window.studioPlayer;
  p.stop();
  p.begin();  // the previous take's error line goes, the page is busy
  const params = {text: text || '', prompt_audio: prompt_audio ? (prompt_audio.path || null) : null,
                  prompt_text: prompt_text || '', mode, instruct_text: instruct_text || '', voice: voice || '',
                  seed: (seed === null || seed === '') ? null : Number(seed), dialogue: !!dialogue,
                  stream: !!stream, speed: stream ? 1 : Number(speed) || 1};
  if (text_streams && !dialogue) p.feed(params, feed_rate);
  else p.play(params);
  return [];
}
