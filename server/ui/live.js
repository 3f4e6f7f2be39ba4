// The page's live half: a session on the WebSocket (/v1/videos/live), its fMP4 fragments played through
// MediaSource, prompt switches marked at the chunk where they applied, stop, and the figures a viewer asks for:
// time to first frame and frames per second (both measured where frames are painted: requestVideoFrameCallback).

import { apiKey, MediaFeed, showError } from "./api.js";

const $ = (id) => document.getElementById(id);

export function setupLive(page) {
  const live = { socket: null, feed: null, stats: null };
  page.live = live;
  const video = $("live-video");

  function log(text, cls) {
    const li = document.createElement("li");
    li.textContent = text;
    if (cls) li.className = cls;
    $("live-log").prepend(li);
  }

  function setState(text) {
    $("live-state").textContent = text;
    live.state = text;
  }

  function buttons(running) {
    $("live-start").disabled = running;
    $("live-stop").disabled = !running;
    $("live-switch").disabled = !running;
  }

  // painted frames: the time to the first, frames per second over the last second, which chunk is on screen
  function onFrame(now, meta) {
    const s = live.stats;
    if (!s || s.video !== video) return;
    if (s.firstFrameMs === null) {
      s.firstFrameMs = now - s.startedAt;
      $("live-ttff").textContent = `${(s.firstFrameMs / 1000).toFixed(2)} s`;
    }
    s.painted.push(now);
    while (s.painted.length && s.painted[0] < now - 1000) s.painted.shift();
    s.frames += 1;
    if (s.framesPerChunk) s.paintedChunk = Math.floor((meta.mediaTime * s.fps + 0.5) / s.framesPerChunk);
    $("live-fps").textContent = s.painted.length.toFixed(0);
    video.requestVideoFrameCallback(onFrame);
  }

  // stay near the live edge: a tab that fell behind skips ahead rather than play ever later
  function keepUp() {
    const b = video.buffered;
    if (b.length && b.end(b.length - 1) - video.currentTime > 1.0) video.currentTime = b.end(b.length - 1) - 0.1;
    if (video.paused && b.length) video.play().catch(() => {});
  }

  // a start image (the causal family's live from an image) goes in the start message as a data URL
  function dataURL(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
  }

  async function start(event) {
    event.preventDefault();
    showError(null);
    const form = $("live-form");
    const msg = { type: "start", prompt: form.prompt.value };
    if (form.size.value.trim()) msg.size = form.size.value.trim();
    if (form.seed.value.trim() !== "") msg.seed = Number(form.seed.value);
    const image = form.image.closest("[hidden]") ? null : form.image.files[0];
    if (image) msg.input_reference = await dataURL(image);
    const url = new URL("/v1/videos/live", location.href);
    url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
    if (apiKey()) url.searchParams.set("api_key", apiKey());
    const socket = new WebSocket(url);
    socket.binaryType = "arraybuffer";
    live.socket = socket;
    if (live.feed) live.feed.close();
    live.feed = new MediaFeed(video);
    live.stats = { video, startedAt: performance.now(), firstFrameMs: null, painted: [], frames: 0, chunks: 0,
                   fps: 16, framesPerChunk: 0, paintedChunk: -1, switches: [], dropped: 0 };
    live.appliedChunk = null;
    video.requestVideoFrameCallback(onFrame);
    $("live-log").replaceChildren();
    $("live-chunks").textContent = "0";
    $("live-ttff").textContent = "–";
    buttons(true);
    setState("starting");
    socket.addEventListener("open", () => socket.send(JSON.stringify(msg)));
    socket.addEventListener("message", (e) => {
      if (typeof e.data !== "string") {
        live.feed.push(new Uint8Array(e.data)).then(keepUp);
        return;
      }
      const ev = JSON.parse(e.data);
      const s = live.stats;
      if (ev.type === "session.created") {
        live.id = ev.id;
        s.fps = ev.fps;
        s.framesPerChunk = ev.frames_per_chunk;
        setState(`live ${ev.size} at ${ev.fps} fps`);
        log(`session ${ev.id}`);
      } else if (ev.type === "chunk") {
        s.chunks += 1;
        s.lastChunk = ev.index;
        s.dropped = ev.dropped;
        $("live-chunks").textContent = String(s.chunks);
        $("live-dropped").textContent = String(ev.dropped);
      } else if (ev.type === "prompt.applied") {
        live.appliedChunk = ev.chunk;
        s.switches.push({ chunk: ev.chunk, prompt: ev.prompt });
        log(`chunk ${ev.chunk}: switched to "${ev.prompt}"`, "switch");
      } else if (ev.type === "prompt.replaced") {
        log(`switch ${ev.prompt_index} replaced by a newer one`);
      } else if (ev.type === "error") {
        showError({ message: ev.message, code: ev.code });
        log(`error ${ev.code}: ${ev.message}`);
      } else if (ev.type === "done") {
        setState(`ended (${ev.reason})`);
        log(`done: ${ev.reason}, ${ev.chunks} chunks, ${ev.frames} frames`);
        live.feed.end();
      }
    });
    socket.addEventListener("close", (e) => {
      buttons(false);
      if (!String(live.state).startsWith("ended")) setState(`closed (${e.code})`);
      live.socket = null;
    });
  }

  function switchPrompt(event) {
    event.preventDefault();
    const prompt = $("switch-form").prompt.value;
    if (!live.socket) return;
    live.stats.switchSentAtChunk = live.stats.lastChunk ?? -1;
    live.socket.send(JSON.stringify({ type: "prompt", prompt }));
    log(`switch sent after chunk ${live.stats.switchSentAtChunk}: "${prompt}"`);
  }

  function stop() {
    if (live.socket) live.socket.send(JSON.stringify({ type: "stop" }));
    setState("stopping");
  }

  $("live-form").addEventListener("submit", start);
  $("switch-form").addEventListener("submit", switchPrompt);
  $("live-stop").addEventListener("click", stop);
}
