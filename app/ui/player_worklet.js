/* The low-latency player's AudioWorklet (app/ui/player.js loads it from this text): a queue of
   Float32Array reads played back to back on the audio thread (gapless by construction).

   From the Worker (through the port it is given in {type: 'source'}): {type: 'pcm', id, samples, at} and
   {type: 'end', id}; a larger id is a new request. From the page: {type: 'flush', id} (Stop) drops the
   queue. Jitter buffer: output starts once `prebufferFrames` are queued (or the stream has ended); when
   the queue runs dry before the end the quantum is padded with silence (an underrun, reported) and it
   waits for the prebuffer again (re-anchored, never overlapping). To the page: started {frame: the
   context frame of the first sample, at: the epoch ms its bytes were read}, underrun, drained {frames},
   flushed, and every POS_QUANTA quanta played pos {frames played, frame: the context frame they reach}. */
const POS_QUANTA = 8;  // 1024 frames, ~43 ms (player_words.js POS_FRAMES)
class StudioPcm extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.prebuffer = options.processorOptions.prebufferFrames;
    this.closed = 0;  // requests up to this id have ended (drained or flushed): their messages are stale
    this.reset(0);
    this.port.onmessage = (e) => this.onMessage(e.data);
  }
  reset(id) {
    // firstAt: the epoch ms the first queued samples were read (the Worker's `at`)
    Object.assign(this, {id, queue: [], firstAt: null, head: 0, queued: 0, playing: false, started: false,
                         ended: false, frames: 0, underruns: 0, quanta: 0});
  }
  onMessage(m) {
    if (m.type === 'source') { m.port.onmessage = (e) => this.onMessage(e.data); return; }
    if (m.id <= this.closed) return;
    if (m.type === 'flush') {
      this.closed = m.id;
      this.reset(0);
      this.port.postMessage({type: 'flushed', id: m.id});
      return;
    }
    if (m.id > this.id) this.reset(m.id);  // the first message of a new request
    if (m.id < this.id) return;
    if (m.type === 'pcm') {
      if (this.firstAt === null) this.firstAt = m.at;
      this.queue.push(m.samples);
      this.queued += m.samples.length;
    }
    else if (m.type === 'end') this.ended = true;
  }
  process(inputs, outputs) {
    const out = outputs[0][0];  // [128] frames, mono
    let i = 0;
    if (!this.playing && this.id && (this.queued >= this.prebuffer || (this.ended && this.queued))) {
      this.playing = true;
      if (!this.started) {
        this.started = true;
        this.port.postMessage({type: 'started', id: this.id, frame: currentFrame, at: this.firstAt});
      }
    }
    if (this.playing) {
      while (i < out.length && this.queue.length) {
        const buf = this.queue[0];
        const n = Math.min(out.length - i, buf.length - this.head);
        out.set(buf.subarray(this.head, this.head + n), i);
        i += n;
        this.head += n;
        this.queued -= n;
        this.frames += n;
        if (this.head === buf.length) { this.queue.shift(); this.head = 0; }
      }
      if (++this.quanta % POS_QUANTA === 0) {
        this.port.postMessage({type: 'pos', id: this.id, frames: this.frames, frame: currentFrame + i});
      }
      if (i < out.length) {  // ran dry inside this quantum
        if (this.ended) {
          this.port.postMessage({type: 'drained', id: this.id, frames: this.frames, underruns: this.underruns});
          this.closed = this.id;
          this.reset(0);
        } else {
          this.underruns += 1;
          this.playing = false;  // re-anchor: wait for the prebuffer again
          this.port.postMessage({type: 'underrun', id: this.id});
        }
      }
    }
    out.fill(0, i);
    return true;
  }
}
registerProcessor('studio-pcm', StudioPcm);
