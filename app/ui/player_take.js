/* js_on_load of the hidden take element (#player_take, app/ui/layout.py; its value: PlayerTake.show's JSON), what
   player.js calls: show(value, final) hands the server the take's JSON (PlayerTake.show: its stats) and the page
   its final WAV (`final`: a FileData of the page's own blob: URL, put into #final_out by FINAL_JS, app/ui/player.py);
   forServer(final, fmt) is the final WAV as the format download (app/ui/download.py) sends it: a blob: take goes up
   only when a listener asks for another format (once per take). */
window.studioTake = {final: null, uploaded: null,
  show: (value, final = null) => { window.studioTake.final = final; props.value = value; },
  forServer: async (final, fmt) => {
    const t = window.studioTake;
    if (!final || !String(final.url).startsWith('blob:')) return final;
    if (fmt === 'wav') return null;
    if (!t.uploaded || t.uploaded.blob !== final.url) {  // one upload per take, also for overlapping asks
      t.uploaded = {blob: final.url, file: (async () => {
        const wav = await (await fetch(final.url)).blob();
        const {path, url} = await upload(new File([wav], final.orig_name, {type: 'audio/wav'}));
        return {...final, path, url};
      })()};
    }
    return t.uploaded.file;
  }};
