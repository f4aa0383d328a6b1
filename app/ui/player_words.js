/* The take's words as it plays (inlined into player.js by app/ui/player.py, in its scope: byId, RATE_HZ,
   wavName, WORDS_VIEW): once a studio/speech take's headers name its request, GET studio/requests/{id}/timings
   (NDJSON, app/server/studio_timings.py) brings each sentence's words as it is aligned into #player_words; the
   word whose [start, end) holds the playback time is marked there each animation frame while the take plays.
   Playback time: the worklet's frames played (its `pos` reports, every POS_FRAMES, extrapolated at most that
   far on the AudioContext clock: underruns and Pause, which suspends the context, hold it) less the output
   latency; in the buffers fallback, the context time since the first sample. The take's SRT and WebVTT come
   last; they become links in #download_subs and go with the take to the history. An aligner that cannot run
   says why once (the panel's only text). Methods of StudioPlayer (Object.assign onto its prototype). */
const POS_FRAMES = 1024;  // the worklet reports its frames played this often (player_worklet.js POS_QUANTA * 128)

const WORDS_METHODS = {

  // a new take: the panel and the subtitle links of the previous one go
  wordsReset(run) {
    run.words = {list: [], note: null, subs: null, done: false, ticking: false};
    run.wordsDone = new Promise((resolve) => { run.words.resolve = resolve; });  // {words, srt, vtt} or null
    WORDS_VIEW.style();
    const box = byId('player_words'), links = byId('download_subs');
    if (box) { box.replaceChildren(); box.classList.add('take-words'); }
    if (links) links.replaceChildren();
    for (const url of this.subUrls || []) URL.revokeObjectURL(url);
    this.subUrls = [];
  },

  // the take's timings as they come; never throws (a take without them plays as before)
  async followWords(run) {
    const w = run.words;
    try {
      const r = await fetch(new URL(`studio/requests/${run.requestId}/timings`, document.baseURI));
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
      let rest = '';
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        const lines = (rest + value).split('\n');
        rest = lines.pop();
        for (const line of lines) if (line) this.wordsLine(run, JSON.parse(line));
      }
    } catch (e) {
      console.warn('studio player: no word timings', e);
    }
    w.done = true;
    w.resolve(w.subs && w.list.length ? {words: w.list, srt: w.subs.srt, vtt: w.subs.vtt} : null);
  },

  // one line: a sentence's words, the take's one note (no timings: why), or the end with the subtitles
  wordsLine(run, m) {
    const w = run.words, box = this.last === run ? byId('player_words') : null;
    if (m.type === 'done') {
      w.subs = m;
      const links = byId('download_subs');
      if (links && box && w.list.length) links.replaceChildren(...WORDS_VIEW.links(m, wavName(run.text, run.voice)
        .replace(/\.wav$/, ''), this.subUrls));
    } else if (!m.words.length && m.note && w.note === null && !w.list.length) {
      w.note = m.note;
      if (box) box.textContent = m.note;
    } else if (w.note === null) {
      w.list.push(...m.words);
      if (box) WORDS_VIEW.add(box, m.words);
      this.wordsTick(run);
    }
  },

  // the marked word follows the playback while the take plays; none once it has ended or stopped
  wordsTick(run) {
    if (run.words.ticking) return;
    run.words.ticking = true;
    const tick = () => {
      const box = byId('player_words');
      const live = this.last === run && (run.state === 'playing' || run.state === 'connecting');
      if (box && this.last === run) WORDS_VIEW.highlight(box, live ? this.playedS(run) * 1000 : -1);
      if (live && box) requestAnimationFrame(tick);
      else run.words.ticking = false;
    };
    requestAnimationFrame(tick);
  },

  // seconds of `run` played out of the speakers by now (never more than it received)
  playedS(run) {
    if (run.firstStartS === null) return 0;
    const received = run.pcm.reduce((n, b) => n + b.length, 0) / 2 / RATE_HZ;
    const now = this.ctx.currentTime * RATE_HZ;  // context frames
    const frames = run.pos ? run.pos.frames + Math.min(POS_FRAMES, Math.max(0, now - run.pos.frame))
      : now - run.firstStartS * RATE_HZ;
    return Math.min(received, Math.max(0, frames / RATE_HZ - (this.ctx.outputLatency || 0)));
  },
};
