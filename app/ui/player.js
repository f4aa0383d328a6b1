() => {
  /* CosyVoice2 Studio low-latency player: defines window.studioPlayer (run once on page load; wired by
     app/ui/player.py). POST studio/speech (relative to the page: works behind the Spaces proxy and a root
     path) answers raw PCM s16le mono 24 kHz as the server produces it. Nothing on the way to the
     speakers waits for this page's main thread, which Gradio keeps busy (panels redrawn every second;
     measured on a loaded 2-core box: the fetch promise resolved 0.2-0.5 s after the response arrived):
     a Worker (player_worker.js) fetches, reads and converts, and posts the samples straight to an
     AudioWorklet (player_worklet.js) on one AudioContext({sampleRate: 24000}) that plays them back to
     back behind a PREBUFFER_S jitter buffer. Where AudioWorklet is missing (it needs a secure context:
     https or localhost; plain http on a LAN address lacks it) the Worker posts the samples here and
     schedule() plays one AudioBufferSourceNode per read at whole-frame times (a late read re-anchored
     PREBUFFER_S ahead). Stop: the Worker aborts the fetch (the server sees the disconnect and aborts the
     vLLM request), the worklet drops its queue (or the nodes are stopped).

     The result: the Worker also hands this page each read's bytes (the body as received, 48 kB per
     second of audio); when the body has ended (or at Stop), handOver() puts them behind a 44-byte
     RIFF/WAVE header in a Blob (the final WAV: exactly the PCM that played), named after the first words
     of the text, and shows it as the page's final WAV from a blob: URL (replay and download: its audio
     came down once and is not sent back); the hidden take element's value (the request id, what this
     page measured) goes to the server's take event, which answers the stats line and details, the
     standard player's (app/ui/player.py PlayerTake).

     Timings (this page's performance.now(), ms; the Worker's converted through timeOrigin): click (the
     Generate click event's timeStamp), request, headers, firstByte, firstSound, end. firstSound is when
     the first sample reaches the output device: its context time (the worklet's currentFrame when it
     starts, or the first node's start time) mapped by ctx.getOutputTimestamp() ({contextTime,
     performanceTime} of the frame being output now), so the output latency is counted; before the first
     render quantum (performanceTime 0) currentTime + outputLatency instead; never earlier than its bytes'
     arrival (soundTime()).
     PREBUFFER_S is 20 ms, below the 40-80 ms one might expect: on loopback the rest of a chunk follows its
     first read within milliseconds; gaps between chunks depend on the server's speed (chunk k+1 must be
     ready before chunk k has played), which a longer start delay does not fix. */
  if (window.studioPlayer) return;
  const RATE_HZ = 24000;
  const PREBUFFER_S = 0.02;
  const PREBUFFER_FRAMES = Math.round(PREBUFFER_S * RATE_HZ);
  const NAME_WORDS = 6, NAME_CHARS = 40;  // the WAV's file name: at most this many words / characters of the text
  const CLICK_MAX_AGE_MS = 2000;  // a click older than this is not the one that started the request
  // an idle AudioContext is suspended (its render thread and the worklet's process() stop: an open idle tab
  // costs nothing); this long after the last request, so back-to-back requests keep it running
  const IDLE_SUSPEND_MS = 5000;
  const STOP_WAIT_MS = 1000;  // Stop hangs up at the latest this long after telling the server
  const TOAST_MS = 8000;  // the error pop-up hides itself after this long (or on a click)

  // the Worker and the AudioWorklet (player_worker.js, player_worklet.js; inlined by app/ui/player.py)
  // run from same-origin blob: URLs
  const WORKER_SRC = __WORKER_SRC__;
  const WORKLET_SRC = __WORKLET_SRC__;
  const RESULT_CSS = __RESULT_CSS__;
  // the player's words in the browser's language, as Gradio picks the labels' (app/ui/locales/page.toml)
  const WORDS = __WORDS__[(navigator.language || 'en').toLowerCase().startsWith('zh') ? 'zh' : 'en'];
  const say = (key, fields = {}) => WORDS[key].replace(/\{(\w+)\}/g, (_, k) => String(fields[k]));
  const blobUrl = (src) => URL.createObjectURL(new Blob([src], {type: 'text/javascript'}));
  const setLine = (text) => {
    const el = document.getElementById('studio_player_line');
    if (el) el.textContent = text;
  };
  const ms = (x) => (x === null || x === undefined || !isFinite(x)) ? '–' : say('ms', {n: Math.round(x)});
  const byId = (id) => document.getElementById(id);

  // RIFF/WAVE header of 16-bit mono PCM at RATE_HZ with nBytes of samples
  function wavHeader(nBytes) {
    const h = new DataView(new ArrayBuffer(44));
    const tag = (at, s) => { for (let i = 0; i < 4; i++) h.setUint8(at + i, s.charCodeAt(i)); };
    tag(0, 'RIFF'); h.setUint32(4, 36 + nBytes, true); tag(8, 'WAVE');
    tag(12, 'fmt '); h.setUint32(16, 16, true); h.setUint16(20, 1, true); h.setUint16(22, 1, true);
    h.setUint32(24, RATE_HZ, true); h.setUint32(28, RATE_HZ * 2, true); h.setUint16(32, 2, true);
    h.setUint16(34, 16, true); tag(36, 'data'); h.setUint32(40, nBytes, true);
    return h.buffer;
  }

  // "alice-hello-there-how-are-you.wav": the saved voice (if any) and the text's first words (letters and
  // digits of any script), as the standard player's (app/ui/takes.py wav_name)
  const words = (t) => (String(t || '').normalize('NFKC').toLowerCase().match(/[\p{L}\p{N}]+/gu) || []);
  function wavName(text, voice) {
    const stem = words(text).slice(0, NAME_WORDS).join('-').slice(0, NAME_CHARS).replace(/-+$/, '') || 'speech';
    const prefix = words(voice).join('-').slice(0, NAME_CHARS / 2).replace(/-+$/, '');
    return prefix ? `${prefix}-${stem}.wav` : `${stem}.wav`;
  }

  __PAGE_SRC__

  __FEED_SRC__

  __WORDS_VIEW_SRC__

  __TAKE_WORDS_SRC__

  class StudioPlayer {
    constructor() {
      this.run = null;       // the request playing now
      this.last = null;      // the latest request (stays after it ends; tests read it)
      this.clickAt = null;   // timeStamp of the latest Generate click
      this.nRuns = 0;
      this.mode = null;      // 'worklet' | 'buffers' once ready
      this.idleTimer = null;  // the pending suspend of the idle AudioContext
      this.toastTimer = null;
      this.finalUrl = null;  // the blob: URL of the take in the page's final WAV (revoked by the next take's)
      this.ctx = new AudioContext({sampleRate: RATE_HZ, latencyHint: 'interactive'});
      this.gain = this.ctx.createGain();  // the volume control; everything plays through it
      this.gain.connect(this.ctx.destination);
      this.ready = this.init();
    }

    async init() {
      this.worker = new Worker(blobUrl(WORKER_SRC));
      this.worker.onmessage = (e) => this.onWorker(e.data);
      this.wireControls();
      this.idleLater();
      this.mode = 'buffers';
      if (!this.ctx.audioWorklet) return;
      try {
        await this.ctx.audioWorklet.addModule(blobUrl(WORKLET_SRC));
        this.node = new AudioWorkletNode(this.ctx, 'studio-pcm', {
          numberOfInputs: 0, numberOfOutputs: 1, outputChannelCount: [1],
          processorOptions: {prebufferFrames: PREBUFFER_FRAMES}});
        this.node.connect(this.gain);
        this.node.port.onmessage = (e) => this.onWorklet(e.data);
        const channel = new MessageChannel();  // worker -> worklet, past this thread
        this.node.port.postMessage({type: 'source', port: channel.port1}, [channel.port1]);
        this.worker.postMessage({type: 'sink', port: channel.port2}, [channel.port2]);
        this.mode = 'worklet';
      } catch (e) {
        console.warn('studio player: AudioWorklet unavailable, scheduling buffers on the page', e);
      }
    }

    resume() {
      clearTimeout(this.idleTimer);
      if (this.ctx.state === 'suspended') this.ctx.resume().catch(() => {});
    }

    // performance.now() time at which context time `t` (s) reaches the output device
    perfTime(t) {
      const ctx = this.ctx;
      const ts = ctx.getOutputTimestamp ? ctx.getOutputTimestamp() : null;
      if (ts && ts.performanceTime > 0) return ts.performanceTime + (t - ts.contextTime) * 1000;
      const latency = ctx.outputLatency || ctx.baseLatency || 0;
      return performance.now() + (t - ctx.currentTime + latency) * 1000;
    }

    // when context time `t` reaches the device, but never before `arrived` (when its samples reached this
    // browser): the output timestamp is an estimate, and where the audio clock drifts from performance.now()
    // (headless or virtual devices, Bluetooth) it has placed the start a few ms before the bytes were read
    soundTime(t, arrived) {
      return Math.max(this.perfTime(t), arrived);
    }

    summary(run) {
      const since = (x) => (x === null ? null : x - run.t.click);
      return say('summary', {first_byte: ms(since(run.t.firstByte)), first_sound: ms(since(run.t.firstSound)),
                             ttfa: ms(run.serverTtfaMs)});
    }

    // `keep` (the Stop button): the audio received so far stays as the final WAV
    stop(keep = false) {
      const run = this.run;
      if (!run) return;
      this.run = null;
      this.setBusy(false);
      this.idleLater();
      const abort = () => this.worker.postMessage({type: 'abort', id: run.id});
      if (keep && run.requestId && run.state === 'playing') {
        // the Stop button: tell the server first (it ends the take when this arrives, and the request's record
        // says "stopped", not a closed tab's "cancelled"); hang up once it answered, or after STOP_WAIT_MS at
        // most (a loaded box, or the browser's full connection pool, may hold it). The sound stops below at once.
        const hangUp = setTimeout(abort, STOP_WAIT_MS);
        fetch(new URL(`studio/requests/${run.requestId}/stop`, document.baseURI), {method: 'POST', keepalive: true})
          .catch(() => {}).finally(() => { clearTimeout(hangUp); abort(); });
      } else {
        abort();
      }
      if (this.mode === 'worklet') this.node.port.postMessage({type: 'flush', id: run.id});
      for (const src of run.sources) {
        try { src.stop(); } catch (e) { /* not started yet */ }
        src.disconnect();
      }
      run.sources.clear();
      run.soundResolve();
      if (run.state === 'connecting' || run.state === 'playing') {
        run.state = 'stopped';
        setLine(`${say('stopped')} · ${this.summary(run)}`);
        if (keep && run.pcm.length) this.handOver(run, true);  // what came is the final WAV
      }
    }

    // `via` {ws, start}: through the WebSocket door (player_feed.js sends the text), not studio/speech
    async play(params, via = null) {
      this.stop();
      const now = performance.now();
      const click = (this.clickAt !== null && now - this.clickAt < CLICK_MAX_AGE_MS) ? this.clickAt : now;
      this.clickAt = null;
      const id = ++this.nRuns;
      const run = {
        id, seq: id, state: 'connecting', voice: params.voice || '', paused: false, requestId: null, serverTtfaMs: null, server: null, seed: null,
        underruns: 0, samples: 0, buffers: 0, bytes: 0, playedFrames: null, firstStartS: null,
        contextState: null, error: null, aborted: false, flushed: false, sources: new Set(), nextFrame: null,
        pcm: [], text: params.text, params, wav: null,  // the body's bytes (Uint8Array per read); the final WAV
        result: null,  // 'shown' | 'kept' (Stop) once handOver() has handed the take to the page
        t: {click, request: now, headers: null, firstByte: null, firstSound: null, end: null},
      };
      run.soundKnown = new Promise((resolve) => { run.soundResolve = resolve; });  // first sound or the end
      this.run = this.last = run;
      this.wordsReset(run);  // the words panel (player_words.js)
      if (window.studioTake) window.studioTake.show('');  // the page's outputs: the previous take goes
      this.setBusy(true);
      setLine(say('connecting'));
      this.resume();
      const pause = byId('player_pause');
      if (pause) { pause.disabled = false; pause.textContent = say('pause'); }
      this.progress(run);
      try {
        await this.ready;
      } catch (e) {
        Object.assign(run, {state: 'error', error: say('cannot_start', {error: e})});
        setLine(`⚠️ ${run.error}`);
        this.showError(run.error);
        this.setBusy(false);
        return;
      }
      run.mode = this.mode;
      this.worker.postMessage(via ? {type: 'start', id, ...via}
        : {type: 'start', id, url: new URL('studio/speech', document.baseURI).href, body: JSON.stringify(params)});
    }

    fromWorker(epochMs) {
      return epochMs - performance.timeOrigin;
    }

    onWorker(m) {
      const run = this.last && this.last.id === m.id ? this.last : null;
      if (!run) return;
      if (m.type === 'headers') {
        run.t.headers = this.fromWorker(m.at);
        const h = m.headers;
        run.requestId = h['x-request-id'];
        run.serverTtfaMs = parseFloat(h['x-ttfa-ms']);
        run.seed = h['x-seed'] === undefined ? null : h['x-seed'];
        // the seed used, into the seed box (#player_seed: app/ui/layout.py, player.py SEED_JS)
        if (m.status === 200 && run.seed !== null && window.studioSeed) window.studioSeed(run.seed);
        run.server = {queueMs: parseFloat(h['x-queue-ms']), referenceMs: parseFloat(h['x-reference-ms']),
                      serverMs: parseFloat(h['x-server-ms']), handlerMs: parseFloat(h['x-handler-ms'])};
        if (m.status === 200 && run.state === 'connecting') run.state = 'playing';
        if (m.status === 200 && run.requestId) this.followWords(run);
      } else if (m.type === 'firstByte') {
        run.t.firstByte = this.fromWorker(m.at);
      } else if (m.type === 'pcm') {
        if (run.state === 'playing') this.schedule(run, m.samples);
      } else if (m.type === 'bytes') {
        if (run.state === 'stopped') return;  // on its way at Stop: the kept take is what came before it
        run.pcm.push(m.raw);
        this.progress(run);
      } else if (m.type === 'end') {
        run.t.end = this.fromWorker(m.at);
        Object.assign(run, {bytes: m.bytes, samples: m.samples, buffers: m.reads});
        if (m.oddByte) run.error = 'the stream ended inside a sample (odd byte count)';
        this.finish(run);
      } else if (m.type === 'aborted') {
        run.aborted = true;
      } else if (m.type === 'error') {
        const broken = run.state === 'playing' && run.pcm.length > 0;  // mid-take: what came is kept
        run.state = 'error';
        run.error = m.message;
        run.soundResolve();
        if (this.run === run) { this.run = null; this.setBusy(false); this.idleLater(); }
        if (broken) { this.handOver(run, true); this.explainBreak(run); return; }
        setLine(`⚠️ ${m.message}`);
        this.showError(m.message);
      }
    }

    onWorklet(m) {
      const run = this.last && this.last.id === m.id ? this.last : null;
      if (!run) return;
      if (m.type === 'started') {
        run.firstStartS = m.frame / RATE_HZ;
        run.t.firstSound = this.soundTime(run.firstStartS, this.fromWorker(m.at));
        run.contextState = this.ctx.state;
        run.soundResolve();
        setLine(`▶ ${this.summary(run)}`);
      } else if (m.type === 'pos') {
        run.pos = m;  // frames played, at context frame m.frame (playedS)
      } else if (m.type === 'underrun') {
        run.underruns += 1;
      } else if (m.type === 'drained') {
        run.playedFrames = m.frames;
        this.done(run);
      } else if (m.type === 'flushed') {
        run.flushed = true;
      }
    }

    // fallback without AudioWorklet: one AudioBufferSourceNode per read, at whole-frame times
    schedule(run, samples) {
      const ctx = this.ctx;
      const now = ctx.currentTime;
      if (run.nextFrame === null || run.nextFrame / RATE_HZ < now + 0.005) {  // first, or late: re-anchor
        if (run.nextFrame !== null) run.underruns += 1;
        run.nextFrame = Math.ceil((now + PREBUFFER_S) * RATE_HZ);
      }
      const buffer = ctx.createBuffer(1, samples.length, RATE_HZ);
      buffer.copyToChannel(samples, 0);
      const src = ctx.createBufferSource();
      src.buffer = buffer;
      src.connect(this.gain);
      const at = run.nextFrame / RATE_HZ;
      src.onended = () => run.sources.delete(src);
      src.start(at);
      run.sources.add(src);
      if (run.t.firstSound === null) {
        run.firstStartS = at;
        run.t.firstSound = this.soundTime(at, performance.now());
        run.contextState = ctx.state;
        run.soundResolve();
        setLine(`▶ ${this.summary(run)}`);
      }
      run.nextFrame += samples.length;
    }

    // the body is complete: the take goes to the page
    async finish(run) {
      if (run.state !== 'playing' && run.state !== 'done') return;  // stopped or failed; 'done' may come first
      await run.soundKnown;  // the worklet reports its start after the body may have ended
      if (this.last === run) this.handOver(run, false);
      if (this.mode === 'buffers') {
        const leftMs = (run.nextFrame / RATE_HZ - this.ctx.currentTime) * 1000;
        setTimeout(() => this.done(run), Math.max(0, leftMs));
      }
    }

    // the take (all of it, or what came before Stop) into the page's final WAV, stats and details: its WAV (the
    // bytes received: exactly the PCM that played) stays in this page, the final WAV a FileData of its blob: URL
    // (the previous take's URL revoked); the take element's value (the request id, what this page measured) goes
    // to the server, whose take event answers the stats line and details (app/ui/player.py); the history gets the Blob
    handOver(run, stopped) {
      const take = window.studioTake;
      const nBytes = run.pcm.reduce((n, b) => n + b.length, 0) & ~1;  // an odd trailing byte is no sample
      run.wav = new Blob([wavHeader(nBytes), ...run.pcm], {type: 'audio/wav'});
      const since = (x) => (x === null ? null : Math.round((x - run.t.click) * 10) / 10);
      const value = {request_id: run.requestId, stopped, samples: nBytes / 2, seed: run.seed,
                     client: {first_byte_ms: since(run.t.firstByte), first_sound_ms: since(run.t.firstSound)}};
      if (!take) { run.result = 'the page has no take element'; return; }
      if (this.finalUrl) URL.revokeObjectURL(this.finalUrl);
      this.finalUrl = URL.createObjectURL(run.wav);
      const final = {path: this.finalUrl, url: this.finalUrl, orig_name: wavName(run.text, run.voice),
                     size: run.wav.size, mime_type: 'audio/wav', is_stream: false, meta: {_type: 'gradio.FileData'}};
      const h = window.studioHistory, p = run.params;
      if (h && !stopped) h.expect(run.requestId, {text: p.text, instruct: p.instruct_text, dialogue: p.dialogue,
                                                  wav: run.wav, timings: run.wordsDone});
      take.show(JSON.stringify(value), final);
      run.result = stopped ? 'kept' : 'shown';
    }

    // the last sample has been played
    done(run) {
      if (run.state !== 'playing') return;
      run.state = 'done';
      run.soundResolve();
      this.progress(run);
      const pause = byId('player_pause');
      if (pause) pause.disabled = true;
      setLine(`✔ ${this.summary(run)} · ` +
              say('done', {seconds: (run.samples / RATE_HZ).toFixed(2), underruns: run.underruns}));
      if (this.run === run) { this.run = null; this.setBusy(false); this.idleLater(); }
    }
  }

  const style = document.createElement('style');  // the player's controls, busy state, error line, pop-up
  style.textContent = RESULT_CSS;
  document.head.appendChild(style);
  Object.assign(StudioPlayer.prototype, PAGE_METHODS, FEED_METHODS, WORDS_METHODS);
  const player = new StudioPlayer();
  window.studioPlayer = player;
  setLine(say('ready'));
  if (byId('studio_busy')) byId('studio_busy').textContent = say('busy');
  // the click itself (the Gradio event runs a little later): Generate's time, and the AudioContext resumed
  // inside the user gesture (browsers' autoplay policy keeps it suspended until one); Stop at once, the take so
  // far kept
  document.addEventListener('click', (e) => {
    const target = e.target && e.target.closest ? e.target : null;
    if (target && target.closest('#go')) {
      player.clickAt = e.timeStamp;
      player.resume();
    } else if (target && target.closest('#stop')) {
      player.stop(true);
      player.setBusy(false);
    }
  }, true);
}
