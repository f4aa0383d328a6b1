/* The page around the low-latency player (inlined into player.js by app/ui/player.py, in its scope: byId,
   RATE_HZ, IDLE_SUSPEND_MS, TOAST_MS, setLine, say: its words): the busy state and errors next to Generate, the
   error pop-up, the player's controls (pause, volume, played / received seconds) and the idle suspend
   of its AudioContext. Methods of StudioPlayer (Object.assign onto its prototype). */
const PAGE_METHODS = {

  // Generate was clicked: the previous error goes, the page is busy
  begin() {
    this.showError('');
    this.setBusy(true);
  },

  setBusy(on) {
    if (on) document.body.dataset.studioBusy = '1';
    else delete document.body.dataset.studioBusy;
    const pause = byId('player_pause');
    if (pause && !on && !this.run) pause.disabled = true;  // nothing plays: nothing to pause
  },

  // the error next to Generate, and (for this player's own errors) a pop-up like Gradio's
  showError(text, popup = true) {
    const el = byId('studio_error');
    if (el) el.textContent = text ? `⚠️ ${text}` : '';
    if (!text || !popup) return;
    let toast = byId('studio_toast');
    if (!toast) {
      toast = document.createElement('div');
      toast.id = 'studio_toast';
      toast.setAttribute('role', 'alert');
      toast.addEventListener('click', () => { toast.hidden = true; });
      document.body.appendChild(toast);
    }
    toast.textContent = say('error', {text});
    toast.hidden = false;
    clearTimeout(this.toastTimer);
    this.toastTimer = setTimeout(() => { toast.hidden = true; }, TOAST_MS);
  },

  wireControls() {
    const pause = byId('player_pause'), volume = byId('player_volume');
    if (pause) pause.addEventListener('click', () => this.togglePause());
    if (volume) volume.addEventListener('input', () => { this.gain.gain.value = Number(volume.value); });
  },

  togglePause() {
    const run = this.run, pause = byId('player_pause');
    if (!run || !pause) return;
    run.paused = !run.paused;
    (run.paused ? this.ctx.suspend() : this.ctx.resume()).catch(() => {});
    pause.textContent = say(run.paused ? 'resume' : 'pause');
  },

  // played / received seconds of `run` (called on each read and at the end: no timer)
  progress(run) {
    const received = run.pcm.reduce((n, b) => n + b.length, 0) / 2 / RATE_HZ;
    const played = run.state === 'done' ? received : (run.firstStartS === null ? 0
      : Math.min(received, Math.max(0, this.ctx.currentTime - run.firstStartS)));
    const bar = byId('player_progress'), time = byId('player_time');
    if (bar) { bar.max = Math.max(received, 1e-3); bar.value = played; }
    if (time) time.textContent = `${played.toFixed(2)} / ${received.toFixed(2)} s`;
  },

  // a take whose stream broke mid-way (its audio so far kept as the final WAV): why, as /health tells it (a
  // dead engine: the server is not ready while it restarts; else the connection)
  async explainBreak(run) {
    const kept = (run.pcm.reduce((n, b) => n + b.length, 0) / 2 / RATE_HZ).toFixed(2);
    let ready = true;
    try { ready = (await (await fetch(new URL('health', document.baseURI))).json()).ready; } catch (e) { /* gone */ }
    const message = say('kept', {why: say(ready ? 'broke' : 'engine_died'), seconds: kept,
                                 retry: say(ready ? 'retry_now' : 'retry_later')});
    run.error = message;
    setLine(`⚠️ ${message}`);
    this.showError(message);
  },

  // the AudioContext runs only while there is audio to play
  idleLater() {
    clearTimeout(this.idleTimer);
    this.idleTimer = setTimeout(() => {
      if (!this.run && this.ctx.state === 'running') this.ctx.suspend().catch(() => {});
    }, IDLE_SUSPEND_MS);
  },
};
