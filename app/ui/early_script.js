(() => {
  const raf = window.requestAnimationFrame.bind(window);
  // StatusTracker's counter: ()=>{set(elapsed, (performance.now() - start) / 1e3), running && loop()}
  const COUNTER = /performance\.now\(\)-\w+\(\w+\)\)\/1e3\),\w+&&\w+\(\)\}$/;
  let loaded = false, running = null, n = 0;  // running: the counter loop whose frame runs now
  const early = new Set();  // counter loops begun before the page's load event: the loader's
  window.studioAppLoaded = () => { loaded = true; };
  window.requestAnimationFrame = (cb) => {
    if (typeof cb !== 'function' || !COUNTER.test(String(cb))) return raf(cb);
    const id = running !== null ? running : ++n;
    if (!loaded && running === null) early.add(id);
    if (loaded && early.has(id)) return 0;  // the unmounted loader's loop ends here
    return raf((t) => { running = id; try { cb(t); } finally { running = null; } });
  };
})();
