/* The low-latency player's Worker (app/ui/player.js starts it from this text): fetch, read, convert.

   {type: 'sink', port}: where samples go (the AudioWorklet's MessagePort; none: to the page).
   {type: 'start', id, url, body, debugSamples}: POST body to url (studio/speech), read the raw PCM
   (s16le mono 24 kHz) as it arrives, int16 -> float32 (x / 32768; an odd trailing byte is carried to the
   next read), post each read's samples and its read time to the sink (transferred: no copy, no main
   thread on the way).
   {type: 'abort', id}: AbortController.abort(); the server sees the disconnect and aborts the request.
   To the page: headers, firstByte, bytes (each read as received, transferred: the final WAV's data),
   copy (debug copies of the samples, the first debugSamples), end, aborted, error; times are epoch ms
   (timeOrigin + now()), comparable across threads. */
let sink = null;
let job = null;
const now = () => performance.timeOrigin + performance.now();  // epoch ms: comparable across threads
const HEADERS = ['x-request-id', 'x-seed', 'x-ttfa-ms', 'x-queue-ms', 'x-reference-ms', 'x-server-ms',
                 'x-handler-ms'];
async function run(m) {
  if (job) job.ac.abort();
  const me = job = {id: m.id, ac: new AbortController()};
  const post = (type, extra, transfer) => self.postMessage({type, id: m.id, ...extra}, transfer || []);
  let debug = 0;
  try {
    const resp = await fetch(m.url, {method: 'POST', headers: {'Content-Type': 'application/json'},
                                     body: m.body, signal: me.ac.signal, cache: 'no-store'});
    const headers = {};
    for (const k of HEADERS) headers[k] = resp.headers.get(k);
    post('headers', {at: now(), status: resp.status, headers});
    if (!resp.ok) {
      let message = `HTTP ${resp.status}`;
      try { message = (await resp.json()).error.message || message; } catch (e) { /* not JSON */ }
      post('error', {message});
      return;
    }
    const reader = resp.body.getReader();
    let carry = null, bytes = 0, total = 0, reads = 0;
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      const at = now();
      let data = value;
      if (carry !== null) {
        data = new Uint8Array(value.length + 1);
        data[0] = carry;
        data.set(value, 1);
        carry = null;
      }
      if (data.length % 2) {
        carry = data[data.length - 1];
        data = data.subarray(0, data.length - 1);
      }
      const view = new DataView(data.buffer, data.byteOffset, data.length);
      const samples = new Float32Array(data.length / 2);
      for (let i = 0; i < samples.length; i++) samples[i] = view.getInt16(2 * i, true) / 32768;
      const copy = debug < m.debugSamples ? samples.slice() : null;
      const n = samples.length;
      if (samples.length && sink) sink.postMessage({type: 'pcm', id: m.id, samples, at}, [samples.buffer]);
      else if (samples.length) post('pcm', {samples}, [samples.buffer]);
      if (bytes === 0) post('firstByte', {at});
      bytes += value.length;
      total += n;
      reads += 1;
      post('bytes', {raw: value}, [value.buffer]);  // converted above: this thread is done with it
      if (copy) {
        debug += copy.length;
        post('copy', {samples: copy}, [copy.buffer]);
      }
    }
    if (sink) sink.postMessage({type: 'end', id: m.id});
    post('end', {at: now(), bytes, samples: total, reads, oddByte: carry !== null});
  } catch (e) {
    if (me.ac.signal.aborted) post('aborted', {});
    else post('error', {message: String(e && e.message ? e.message : e)});
  } finally {
    if (job === me) job = null;
  }
}
self.onmessage = (e) => {
  const m = e.data;
  if (m.type === 'sink') sink = m.port;
  else if (m.type === 'abort' && job && job.id === m.id) job.ac.abort();
  else if (m.type === 'start') run(m);
};
