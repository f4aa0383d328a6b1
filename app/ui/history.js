() => {
  /* CosyVoice2 Studio: the history of takes (run once on page load; wired by app/ui/history.py). Defines
     window.studioHistory. Each finished take of either player (fromTake() once the page shows it: after
     `synthesize` or the low-latency player's take event) is kept in this browser's IndexedDB:
     per browser profile, so it survives a reload and no other visitor sees it; the server keeps nothing.
     A take: {id, createdAt, text, instruct, dialogue, voice, mode, seed, speed, stream, player, statsLine,
     details, name, wav (the final WAV, a Blob: the very bytes the page offered), bytes, and where its words
     were aligned: words [{word, start_ms, end_ms, interpolated}], srt, vtt}. Stopped and failed
     takes are not kept. The list (newest first) is drawn into #history_list: per take an <audio> and a
     download link (blob: URLs, revoked at each redraw), "Use these settings" (text, dialogue box, mode,
     instruction, seed, stream and speed back into the inputs) and Delete; #history_clear empties it once
     confirmed.
     Where IndexedDB is missing or fails (private windows) #history_status says the history is unavailable,
     and a take that cannot be written (quota) is reported there; Generate is never affected: every entry
     point catches its own errors. Words: LABELS[lang] (the history_* labels, app/ui/locales/labels.toml),
     the page's language being the browser's (as Gradio's own words). */
  if (window.studioHistory) return [];
  const HISTORY_MAX_TAKES = 20;  // the newest this many takes are kept ...
  // ... within this many bytes of WAV (50 MiB: ~18 min of 24 kHz 16-bit mono); the oldest go first
  const HISTORY_MAX_BYTES = 50 * 1024 * 1024;
  const DB_NAME = 'cosyvoice-studio-history', STORE = 'takes', DB_VERSION = 1;
  const TEXT_CHARS = 80;  // a row shows this much of the text (all of it on hover)
  const LABELS = __LABELS__;
  const CSS = `#history_list .history-take { border-top: 1px solid var(--border-color-primary, #ddd); padding: 6px 0; }
#history_list .history-text { font-weight: 600; overflow-wrap: anywhere; }
#history_list .history-facts, #history_list .history-stats { font-size: 0.85em; opacity: 0.8; }
#history_list audio { width: 100%; height: 36px; margin: 4px 0; }
#history_list .history-actions { display: flex; gap: 10px; align-items: center; flex-wrap: wrap; }
#history button { font-size: 0.85em; font-weight: 500; padding: 2px 10px; }
#history_status:empty { display: none; }`;
  const byId = (id) => document.getElementById(id);
  const label = (key, fields = {}) => {
    const lang = (navigator.language || 'en').toLowerCase().startsWith('zh') ? 'zh' : 'en';
    return LABELS[lang][key].replace(/\{(\w+)\}/g, (_, k) => String(fields[k]));
  };
  const request = (req) => new Promise((resolve, reject) => {
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(req.error);
  });
  const done = (tx) => new Promise((resolve, reject) => {
    tx.oncomplete = () => resolve();
    tx.onerror = tx.onabort = () => reject(tx.error || new Error('transaction aborted'));
  });
  // an element with a class and text (user text only ever goes in as textContent)
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };
  __WORDS_VIEW_SRC__

  class StudioHistory {
    constructor() {
      this.limits = {maxTakes: HISTORY_MAX_TAKES, maxBytes: HISTORY_MAX_BYTES};
      this.state = 'opening';  // 'ready' | 'unavailable' (tests wait on it)
      this.error = null;       // why the history is unavailable
      this.note = null;        // why the latest take was not kept (the history stays)
      this.urls = [];          // blob: URLs of the rows drawn now
      this.expected = new Map();  // the low-latency player's takes on their way to the page, by request id
      this.channel = window.BroadcastChannel ? new BroadcastChannel(DB_NAME) : null;  // other tabs redraw
      if (this.channel) this.channel.onmessage = () => this.render();
      const style = el('style');
      style.textContent = CSS;
      document.head.appendChild(style);
      this.wire();
      this.db = this.open();
      this.db.then(() => { this.state = 'ready'; }, (e) => this.unavailable(e)).then(() => this.render());
    }

    open() {
      if (!window.indexedDB) return Promise.reject(new Error('no IndexedDB'));
      const req = indexedDB.open(DB_NAME, DB_VERSION);
      req.onupgradeneeded = () => req.result.createObjectStore(STORE, {keyPath: 'id', autoIncrement: true});
      return request(req);
    }

    unavailable(e) {
      this.state = 'unavailable';
      this.error = String(e && e.message ? e.message : e);
      console.warn('studio history unavailable:', e);
    }

    // the takes, newest first (ids grow with each take)
    async list() {
      const db = await this.db;
      const takes = await request(db.transaction(STORE).objectStore(STORE).getAll());
      return takes.sort((a, b) => b.id - a.id);
    }

    // keep a finished take, then drop the oldest beyond the limits; never throws
    async add(take) {
      try {
        if (!take || !(take.wav instanceof Blob) || !take.wav.size) return;
        const db = await this.db;
        const tx = db.transaction(STORE, 'readwrite');
        // details: a plain copy (Gradio hands over a proxy, which IndexedDB cannot clone)
        const details = take.details ? JSON.parse(JSON.stringify(take.details)) : null;
        tx.objectStore(STORE).add({...take, details, createdAt: Date.now(), bytes: take.wav.size});
        await done(tx);
        await this.prune();
        this.note = null;
      } catch (e) {  // e.g. QuotaExceededError: this take is not kept, the history stays
        this.note = label('not_kept', {reason: String(e && e.message ? e.message : e)});
        console.warn('studio history: the take was not kept', e);
      }
      await this.changed();
    }

    // the newest takes within maxTakes and maxBytes stay; from the first that does not fit on, all older go
    async prune() {
      const takes = await this.list();
      let total = 0, full = false;
      const drop = [];
      takes.forEach((t, i) => {
        total += t.bytes;
        full = full || i >= this.limits.maxTakes || total > this.limits.maxBytes;
        if (full) drop.push(t.id);
      });
      if (!drop.length) return;
      const tx = (await this.db).transaction(STORE, 'readwrite');
      for (const id of drop) tx.objectStore(STORE).delete(id);
      await done(tx);
    }

    // tests set small limits here (the same pruning as in use); returns the limits
    async configure(limits) {
      Object.assign(this.limits, limits);
      try { await this.prune(); } catch (e) { this.unavailable(e); }
      await this.changed();
      return this.limits;
    }

    async remove(id) {
      try {
        const tx = (await this.db).transaction(STORE, 'readwrite');
        tx.objectStore(STORE).delete(id);
        await done(tx);
      } catch (e) { this.unavailable(e); }
      await this.changed();
    }

    async clear() {
      try {
        const tx = (await this.db).transaction(STORE, 'readwrite');
        tx.objectStore(STORE).clear();
        await done(tx);
      } catch (e) { this.unavailable(e); }
      await this.changed();
    }

    async changed() {
      if (this.channel) this.channel.postMessage('changed');
      await this.render();
    }

    // the page's player hands the page a finished take: what it was asked and its WAV (the bytes it
    // played: not fetched back), for fromTake(); by request id, so a late answer never takes another's
    expect(requestId, params) {
      if (this.expected.size > 8) this.expected.clear();  // takes whose event failed
      this.expected.set(requestId, params);
    }

    // a take is on the page: its final WAV (a FileData), details and stats line (Markdown); a stopped take
    // (details.stopped) is not kept, and the page's outputs cleared for a new take (no final WAV) change nothing
    async fromTake(final, details, stats = '') {
      if (!final || !final.url || !details) return;
      const asked = this.expected.get(details.request_id);
      this.expected.delete(details.request_id);
      if (!asked || details.stopped) return;
      try {
        const {timings, ...kept} = asked;  // the take's words and subtitles, once aligned (player_words.js)
        const wav = asked.wav, words = timings ? await timings : null;
        await this.add({...kept, ...(words || {}), voice: details.voice || '', mode: details.mode, seed: details.seed,
                        speed: details.speed, stream: details.stream, player: details.player,
                        statsLine: String(stats || '').replace(/\*\*/g, ''), details,
                        name: final.orig_name || 'speech.wav', wav});
      } catch (e) {
        console.warn('studio history: the take was not kept', e);
      }
    }

    wire() {
      document.addEventListener('click', (e) => {
        const t = e.target && e.target.closest ? e.target : null;
        if (!t) return;
        if (t.closest('#history_clear')) {  // asked first, in the page's language; Cancel keeps every take
          const n = document.querySelectorAll('#history_list .history-take').length;
          if (window.confirm(label('clear_confirm', {n}))) this.clear();
          return;
        }
        const button = t.closest('#history_list button[data-act]');
        if (!button) return;
        const id = Number(button.closest('[data-id]').dataset.id);
        if (button.dataset.act === 'delete') this.remove(id);
        else if (button.dataset.act === 'use') this.useSettings(id);
      });
    }

    // "Use these settings": the take's text, dialogue box, mode, instruction, seed, stream and speed into the
    // inputs, as the outputs of the hidden #history_use element's change event (app/ui/history.py); not the
    // voice: the saved-voice list sits in a closed accordion, and the row names the voice
    async useSettings(id) {
      const t = (await this.list()).find((take) => take.id === id);
      if (t && window.studioUse) {
        window.studioUse({text: t.text, dialogue: t.dialogue, mode: t.mode, instruct: t.instruct, seed: t.seed,
                          stream: t.stream, speed: t.speed});
      }
    }

    async render() {
      const list = byId('history_list'), status = byId('history_status'), clear = byId('history_clear');
      if (!list) return;
      if (clear) clear.textContent = label('clear');
      if (this.state !== 'ready') {
        if (status) status.textContent = this.state === 'unavailable' ? label('unavailable', {reason: this.error}) : '';
        return;
      }
      let takes;
      try { takes = await this.list(); } catch (e) { this.unavailable(e); return this.render(); }
      for (const url of this.urls) URL.revokeObjectURL(url);
      this.urls = [];
      if (status) status.textContent = this.note || (takes.length ? label('info', {n: this.limits.maxTakes,
        mb: Math.round(this.limits.maxBytes / 1048576)}) : label('empty'));
      list.replaceChildren(...takes.map((t) => this.row(t)));
      if (clear) clear.disabled = !takes.length;
    }

    row(t) {
      const url = URL.createObjectURL(t.wav);
      this.urls.push(url);
      const div = el('div', 'history-take');
      div.dataset.id = String(t.id);
      const text = t.text || '';
      const shown = el('div', 'history-text', text.length > TEXT_CHARS ? `${text.slice(0, TEXT_CHARS)}…` : text);
      shown.title = text;
      const mode = LABELS.en[`mode_${t.mode}`] ? label(`mode_${t.mode}`) : String(t.mode);
      const speed = Number(t.speed || 1).toFixed(2);
      const when = new Date(t.createdAt).toLocaleTimeString();
      const facts = el('div', 'history-facts', `${when} · ${t.voice || label('reference')} · ${mode} · ` +
                       label('facts', {seed: t.seed, speed}));
      const d = t.details || {};
      const num = (x, digits) => (typeof x === 'number' ? x.toFixed(digits) : '–');
      const stats = el('div', 'history-stats', label('stats', {ttfa: num(d.ttfa_ms, 0), rtf: num(d.rtf, 2),
                                                               audio: num(d.audio_s, 2)}));
      stats.title = t.statsLine || '';
      const audio = el('audio');
      audio.controls = true;
      audio.preload = 'none';
      audio.src = url;
      const link = el('a', null, `⬇ ${label('download')}`);
      link.href = url;
      link.download = t.name || 'speech.wav';
      const actions = el('div', 'history-actions');
      const use = el('button', 'history-use', label('use'));
      use.dataset.act = 'use';
      const del = el('button', 'history-delete', label('delete'));
      del.dataset.act = 'delete';
      for (const b of [use, del]) b.type = 'button';
      const timed = WORDS_VIEW.forRow(t, audio, this.urls);  // its words and SRT/WebVTT (words.js)
      actions.append(link, ...timed.links, use, del);
      div.append(shown, facts, stats, audio, ...timed.words, actions);
      return div;
    }
  }

  window.studioHistory = new StudioHistory();
  return [];
}
