/* A take's words on the page (inlined into player.js and history.js by app/ui/player.py and history.py, in their
   scope: byId): drawn as spans with their times (ms from the take's first sample, as GET
   studio/requests/{id}/timings sends them: app/server/studio_timings.py), the one being spoken marked
   `word-now`; the take's SRT and WebVTT (made on the server from the same words) as download links. */
const WORDS_CSS = `.take-words { line-height: 1.9; padding: 4px 8px; overflow-wrap: anywhere; }
.take-words:empty { display: none; }
.take-words .word { border-radius: 3px; padding: 0 1px; }
.take-words .word-guess { text-decoration: underline dotted; }
.take-words .word-now { background: #fde68a; color: #111; }
#download_subs a, .history-actions a.download-srt, .history-actions a.download-vtt { margin-right: 10px; }`;
const CJK_EDGE = /[\u3000-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\uffef]/;  // no space beside these (as subtitles.py)
const SUBTITLES = [['srt', 'application/x-subrip', 'SRT'], ['vtt', 'text/vtt', 'WebVTT']];  // ext, type, link text

const WORDS_VIEW = {
  style() {
    if (byId('take_words_css')) return;
    const s = document.createElement('style');
    s.id = 'take_words_css';
    s.textContent = WORDS_CSS;
    document.head.appendChild(s);
  },

  // `words` [{word, start_ms, end_ms, interpolated}] after the box's words, one span each (`word-guess`: the
  // aligner missed it, its times are interpolated)
  add(box, words) {
    for (const w of words) {
      const prev = box.lastElementChild ? box.lastElementChild.textContent : '';
      if (prev && !CJK_EDGE.test(prev.slice(-1)) && !CJK_EDGE.test(w.word.slice(0, 1))) box.append(' ');
      const span = document.createElement('span');
      span.className = w.interpolated ? 'word word-guess' : 'word';
      span.dataset.start = String(w.start_ms);
      span.dataset.end = String(w.end_ms);
      span.textContent = w.word;
      box.append(span);
    }
  },

  // the word whose [start, end) holds `ms` gets `word-now`, no word where none does (a pause between words, -1);
  // the box's data-ms is the time marked, floored: whole ms inside the word too (rounded, 698.7 would read as
  // its end 699)
  highlight(box, ms) {
    const holds = (s) => Number(s.dataset.start) <= ms && ms < Number(s.dataset.end);
    const now = box.querySelector('.word-now');
    if (!now || !holds(now)) {
      if (now) now.classList.remove('word-now');
      const next = [...box.children].find(holds);
      if (next) next.classList.add('word-now');
    }
    box.dataset.ms = String(Math.floor(ms));
  },

  // `subs` {srt, vtt} as download links named `stem`.srt / .vtt; their blob: URLs are pushed onto `urls`
  links(subs, stem, urls) {
    return SUBTITLES.map(([ext, type, text]) => {
      const url = URL.createObjectURL(new Blob([subs[ext]], {type}));
      urls.push(url);
      const a = document.createElement('a');
      Object.assign(a, {href: url, download: `${stem}.${ext}`, textContent: `⬇ ${text}`, className: `download-${ext}`});
      return a;
    });
  },

  // a history row's words (marked as its <audio> plays) and subtitle links: [] for a take without words
  forRow(take, audio, urls) {
    if (!take.words || !take.words.length || !take.srt) return {words: [], links: []};
    this.style();
    const box = document.createElement('div');
    box.className = 'take-words history-words';
    this.add(box, take.words);
    const mark = () => this.highlight(box, audio.paused && audio.ended ? -1 : audio.currentTime * 1000);
    for (const name of ['timeupdate', 'seeked', 'ended']) audio.addEventListener(name, mark);
    return {words: [box], links: this.links(take, (take.name || 'speech.wav').replace(/\.wav$/, ''), urls)};
  },
};
