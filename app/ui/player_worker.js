/* The low-latency player's Worker (app/ui/player.js starts it from this text): fetch, read, convert.

   {type: 'sink', port}: where samples go (the AudioWorklet's MessagePort; none: to the page).
   {type: 'start', id, url, body}: POST body to url (studio/speech), read the raw PCM
   (s16le mono 24 kHz) as it arrives, int16 -> float32 (x / 32768; an odd trailing byte is carried to the
   next read), post each read's samples and its read time to the sink (transferred: no copy, no main
   thread on the way).
   {type: 'start', id, ws, start}: the same through the WebSocket door (text that streams in,
   v1/audio/speech/stream): `start` is its first message; {type: 'send', id, message} sends the next one
   (text deltas, close; held until the socket is open); `started` stands for the headers, a normal close
   for the body's end, an `error` message or another close code for an error.
   {type: 'abort', id}: AbortController.abort(); the server sees the disconnect and aborts the request.
   To the page: headers, firstByte, bytes (each read as received, transferred: the final WAV's data),
   end, aborted, error; times are epoch ms
   (timeOrigin + now()), comparable across threads. */
let sink = null;
let job = null;
const now = () => performance.timeOrigin + performance.now();  // epoch ms: comparable across threads
const HEADERS = ['x-request-id', 'x-seed', 'x-ttfa-ms', 'x-queue-ms', 'x-reference-ms', 'x-server-ms',
                 'x-handler-ms'];
// one body's bytes as they arrive: int16 -> float32 to the sink, the raw bytes to the page
function body(m, post) {
  let carry = null, bytes = 0, total = 0, reads = 0;
  return {
    read(value) {
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
      const n = samples.length;
      if (samples.length && sink) sink.postMessage({type: 'pcm', id: m.id, samples, at}, [samples.buffer]);
      else if (samples.length) post('pcm', {samples}, [samples.buffer]);
      if (bytes === 0) post('firstByte', {at});
      bytes += value.length;
      total += n;
      reads += 1;
      post('bytes', {raw: value}, [value.buffer]);  // converted above: this thread is done with it
    },
    end() {
      if (sink) sink.postMessage({type: 'end', id: m.id});
      post('end', {at: now(), bytes, samples: total, reads, oddByte: carry !== null});
    },
  };
}
async function run(m) {
  if (job) job.ac.abort();
  const me = job = {id: m.id, ac: new AbortController()};
  const post = (type, extra, transfer) => self.postMessage({type, id: m.id, ...extra}, transfer || []);
  if (m.ws) return talk(m, me, post);
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
    const reader = resp.body.getReader(), b = body(m, post);
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      b.read(value);
    }
    b.end();
  } catch (e) {
    if (me.ac.signal.aborted) post('aborted', {});
    else post('error', {message: String(e && e.message ? e.message : e)});
  } finally {
    if (job === me) job = null;
  }
}
// the WebSocket door: messages out as the page sends them, audio frames in as the body's reads
function talk(m, me, post) {
  const ws = new WebSocket(m.ws), b = body(m, post);
  ws.binaryType = 'arraybuffer';
  let failed = false;
  me.held = [m.start];
  me.send = (message) => { if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(message)); else me.held.push(message); };
  ws.onopen = () => { for (const message of me.held.splice(0)) ws.send(JSON.stringify(message)); };
  ws.onmessage = (e) => {
    if (typeof e.data !== 'string') { b.read(new Uint8Array(e.data)); return; }
    const msg = JSON.parse(e.data);
    if (msg.type === 'started') {
      post('headers', {at: now(), status: 200, headers: {'x-request-id': msg.request_id, 'x-seed': String(msg.seed)}});
    } else if (msg.type === 'error') {
      failed = true;
      post('error', {message: msg.message});
    }
  };
  ws.onclose = (e) => {
    if (job === me) job = null;
    if (me.ac.signal.aborted) post('aborted', {});
    else if (e.code === 1000 && !failed) b.end();
    else if (!failed) post('error', {message: e.reason || `the connection closed (code ${e.code})`});
  };
  me.ac.signal.addEventListener('abort', () => ws.close());
}
self.onmessage = (e) => {
  const m = e.data;
  if (m.type === 'sink') sink = m.port;
  else if (m.type === 'abort' && job && job.id === m.id) job.ac.abort();
  else if (m.type === 'send' && job && job.id === m.id && job.send) job.send(m.message);
  else if (m.type === 'start') run(m);
};
