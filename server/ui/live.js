// The page's live half: a session on the WebSocket (/v1/videos/live), its fMP4 fragments played through
// MediaSource, prompt switches marked at the chunk where they applied, stop, and the figures a viewer asks for:
// time to first frame, frames per second and the latency from a chunk leaving the engine to its first frame being
// painted (all measured where frames are painted: requestVideoFrameCallback). The frames come either as fMP4
// fragments on the socket (MediaSource) or as a WebRTC track (the socket then carries the signalling and events).

import { apiKey, MediaFeed, showError } from "./api.js";

const $ = (id) => document.getElementById(id);

export function setupLive(page, history) {
  const live = { socket: null, feed: null, stats: { frames: 0, chunks: 0 }, logged: 0 };
  page.live = live;
  const video = $("live-video");

  // the newest entry first, numbered in the order they happened (the list counts down: the newest is the highest)
  function log(text, cls) {
    const li = document.createElement("li");
    live.logged += 1;
    li.value = live.logged;
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
      s.firstFrame = still(meta);
    }
    s.painted.push(now);
    while (s.painted.length && s.painted[0] < now - 1000) s.painted.shift();
    s.frames += 1;
    const chunk = chunkOf(s, meta);
    if (chunk) {
      s.paintedChunk = chunk.index;
      if (chunk.latencyMs === undefined && chunk.t) {
        chunk.latencyMs = performance.timeOrigin + (meta.expectedDisplayTime || now) - chunk.t * 1000;
        s.latencies.push(chunk.latencyMs);
        const recent = s.latencies.slice(-10).sort((a, b) => a - b);
        $("live-latency").textContent = `${Math.round(recent[recent.length >> 1])} ms (${s.transport})`;
      }
    }
    $("live-fps").textContent = s.painted.length.toFixed(0);
    video.requestVideoFrameCallback(onFrame);
  }

  // the first painted frame as it was drawn, with its media time: a session started from an image shows the image
  // first, for 1/fps only (kept for whoever asks: the browser tests read it)
  function still(meta) {
    const canvas = document.createElement("canvas");
    canvas.width = video.videoWidth;
    canvas.height = video.videoHeight;
    canvas.getContext("2d").drawImage(video, 0, 0);
    return { canvas, mediaTime: meta.mediaTime };
  }

  // which chunk a painted frame belongs to: by its place in the stream (fMP4: frames appended before it; WebRTC:
  // its RTP timestamp less the first frame's, against the chunk's first frame's track timestamp)
  function chunkOf(s, meta) {
    let pos;
    if (s.transport === "webrtc") {
      if (meta.rtpTimestamp === undefined) return null;
      if (s.rtp0 === undefined) s.rtp0 = meta.rtpTimestamp;
      pos = (meta.rtpTimestamp - s.rtp0) >>> 0;
    } else {
      pos = Math.round(meta.mediaTime * s.fps);
    }
    for (let i = s.chunkList.length - 1; i >= 0; i--) {
      if (s.chunkList[i].pos !== undefined && s.chunkList[i].pos <= pos) return s.chunkList[i];
    }
    return null;
  }

  async function offer() {
    const pc = new RTCPeerConnection();
    pc.addTransceiver("video", { direction: "recvonly" });
    pc.addEventListener("track", (e) => {
      video.srcObject = new MediaStream([e.track]);
      video.play().catch(() => {});
    });
    await pc.setLocalDescription(await pc.createOffer());
    await new Promise((resolve) => {           // every host candidate in the offer: no trickle over the socket
      if (pc.iceGatheringState === "complete") { resolve(); return; }
      pc.addEventListener("icegatheringstatechange", () => pc.iceGatheringState === "complete" && resolve());
      setTimeout(resolve, 3000);
    });
    live.pc = pc;
    return { type: "offer", sdp: pc.localDescription.sdp };
  }

  // stay near the live edge: a tab that fell behind skips ahead rather than play ever later (once the first frame
  // was painted: a session's start, its image's frame when it began from one, is always shown)
  function keepUp() {
    const b = video.buffered;
    const behind = b.length && b.end(b.length - 1) - video.currentTime > 1.0;
    if (behind && live.stats.firstFrameMs !== null) video.currentTime = b.end(b.length - 1) - 0.1;
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
    if (form.record.checked) msg.record = true;          // kept as a video: in the history once it ends
    const transport = form.transport.value;
    live.stats = { video, startedAt: performance.now(), firstFrameMs: null, painted: [], frames: 0, chunks: 0,
                   fps: 16, framesPerChunk: 0, paintedChunk: -1, switches: [], switchBy: null, dropped: 0, transport,
                   chunkList: [], framesReceived: 0, latencies: [] };
    live.state = "starting";
    const image = form.image.closest("[hidden]") ? null : form.image.files[0];
    if (image) msg.input_reference = await dataURL(image);
    if (live.pc) { live.pc.close(); live.pc = null; }
    if (live.feed) { live.feed.close(); live.feed = null; }
    video.removeAttribute("src");
    video.srcObject = null;
    if (transport === "webrtc") msg.webrtc = await offer();
    else live.feed = new MediaFeed(video);
    const url = new URL("/v1/videos/live", location.href);
    url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
    const socket = new WebSocket(url);            // the key goes in the first message, never in the URL (logged)
    socket.binaryType = "arraybuffer";
    live.socket = socket;
    $("live-latency").textContent = "–";
    live.appliedChunk = null;
    if (!live.watching) { video.requestVideoFrameCallback(onFrame); live.watching = true; }   // one chain a page
    $("live-log").replaceChildren();
    live.logged = 0;
    live.recorded = null;
    $("live-chunks").textContent = "0";
    $("live-ttff").textContent = "–";
    buttons(true);
    setState("starting");
    socket.addEventListener("open", () => {
      if (apiKey()) socket.send(JSON.stringify({ type: "auth", api_key: apiKey() }));
      socket.send(JSON.stringify(msg));
    });
    socket.addEventListener("message", (e) => {
      if (typeof e.data !== "string") {
        if (live.feed) live.feed.push(new Uint8Array(e.data)).then(keepUp);
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
      } else if (ev.type === "chunk.sent") {              // WebRTC: the chunk's first frame's track timestamp
        const entry = s.chunkList.find((c) => c.index === ev.index);
        if (entry) entry.pos = ev.pts;
        else s.chunkList.push({ index: ev.index, pos: ev.pts });
      } else if (ev.type === "webrtc.answer") {
        live.pc.setRemoteDescription(ev.answer).catch((err) => showError(err));
      } else if (ev.type === "chunk") {
        const entry = s.chunkList.find((c) => c.index === ev.index);
        if (entry) entry.t = ev.t;
        else s.chunkList.push({ index: ev.index, t: ev.t, pos: s.transport === "webrtc" ? undefined : s.framesReceived });
        if (s.chunkList.length > 200) s.chunkList.shift();
        s.framesReceived += ev.frames;
        s.chunks += 1;
        s.lastChunk = ev.index;
        s.dropped = ev.dropped;
        $("live-chunks").textContent = String(s.chunks);
        $("live-dropped").textContent = String(ev.dropped);
      } else if (ev.type === "prompt.applied") {
        live.appliedChunk = ev.chunk;
        s.switches.push({ chunk: ev.chunk, prompt: ev.prompt });
        log(`chunk ${ev.chunk}: switched to "${ev.prompt}"`, "switch");
      } else if (ev.type === "prompt.received") {     // the engine's promise: applied by this chunk
        s.switchBy = ev.by_chunk;
        log(`switch ${ev.prompt_index} received: applies by chunk ${ev.by_chunk}`);
      } else if (ev.type === "prompt.replaced") {
        log(`switch ${ev.prompt_index} replaced by a newer one`);
      } else if (ev.type === "error") {
        showError({ message: ev.message, code: ev.code });
        log(`error ${ev.code}: ${ev.message}`);
      } else if (ev.type === "done") {
        setState(`ended (${ev.reason})`);
        log(`done: ${ev.reason}, ${ev.chunks} chunks, ${ev.frames} frames`);
        if (ev.video_id) {
          live.recorded = ev.video_id;
          log(`recorded as ${ev.video_id} (in the history: play, download)`);
          history.refresh();
        }
        if (live.feed) live.feed.end();
      }
    });
    socket.addEventListener("close", (e) => {
      buttons(false);
      if (live.pc) { live.pc.close(); live.pc = null; }
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
