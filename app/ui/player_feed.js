/* Text that streams in (the page's switch; inlined into player.js by app/ui/player.py, in its scope): the
   text box's words (`typed`: its value, which the box's change event hands over, app/ui/player.py TYPED_JS)
   go to the WebSocket door (v1/audio/speech/stream) one at a time, at the chosen rate, as
   they are typed or pasted; what comes back plays through this player like any take, whose WAV and stats
   then reach the page's outputs and history. A word is sent once whitespace (or a Chinese character)
   follows it; once every word is
   out and the box has not changed for FEED_IDLE_MS, the rest goes and the session closes. Methods of
   StudioPlayer (Object.assign onto its prototype). */
const FEED_IDLE_MS = 1500;
const WORD = /^\s*(?:\p{sc=Han}|[^\s\p{sc=Han}]+(?:\s|(?=\p{sc=Han})))/u;  // a Chinese character is a word
const FEED_METHODS = {

  async feed(params, wordsPerS) {
    const url = new URL('v1/audio/speech/stream', document.baseURI);
    url.protocol = url.protocol === 'https:' ? 'wss:' : 'ws:';
    const start = {type: 'start', response_format: 'pcm', seed: params.seed, voice: params.voice || null,
                   prompt_audio: params.prompt_audio, prompt_text: params.prompt_text, mode: params.mode,
                   instructions: params.mode === 'instruct' ? params.instruct_text : null};
    await this.play(params, {ws: url.href, start});
    const run = this.last, box = () => (typeof this.typed === 'string' ? this.typed : params.text);
    if (!run || run.state !== 'connecting') return;
    let sent = '', seen = box(), changedAt = performance.now();
    run.feed = {sent: 0, closed: false};
    const timer = setInterval(() => {
      const live = this.last === run && (run.state === 'connecting' || run.state === 'playing');
      if (!live) { clearInterval(timer); return; }
      const text = box();
      if (text !== seen) { seen = text; changedAt = performance.now(); }
      const rest = text.startsWith(sent) ? text.slice(sent.length) : '';  // an edit before the sent part: ignored
      const word = rest.match(WORD);
      if (word) {
        sent += word[0];
        this.worker.postMessage({type: 'send', id: run.id, message: {type: 'text', text: word[0]}});
        run.feed.sent += 1;
      } else if (performance.now() - changedAt > FEED_IDLE_MS) {
        if (rest.trim()) this.worker.postMessage({type: 'send', id: run.id, message: {type: 'text', text: rest}});
        sent += rest;
        this.worker.postMessage({type: 'send', id: run.id, message: {type: 'close'}});
        run.text = run.params.text = sent;  // the take's text: what was spoken (its WAV's name, the history)
        run.feed.closed = true;
        clearInterval(timer);
      }
    }, 1000 / Math.max(0.5, Number(wordsPerS) || 3));
  },
};
