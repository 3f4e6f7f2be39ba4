// The API as the page calls it: the key kept for this tab only (sessionStorage), sent as the API takes it
// (Authorization: Bearer; the live socket's first message, never a URL), and the server's error envelope shown,
// never a blank page.

const KEY = "longserve.api_key";

export function apiKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

export function authHeaders() {
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

export class APIError extends Error {
  constructor(status, envelope) {
    const e = (envelope && envelope.error) || {};
    super(e.message || `HTTP ${status}`);
    this.status = status;
    this.code = e.code || null;
    this.param = e.param || null;
  }
}

// fetch with the key; a non-2xx answer -> APIError carrying the envelope's message
export async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: { ...authHeaders(), ...(options.headers || {}) } });
  if (!response.ok) {
    let envelope = null;
    try { envelope = await response.json(); } catch { /* not JSON: the status says it */ }
    throw new APIError(response.status, envelope);
  }
  return response;
}

export function showError(error) {
  const box = document.getElementById("error");
  if (!error) { box.hidden = true; box.textContent = ""; return; }
  const status = error.status ? `${error.status}` : "error";
  box.textContent = `${status}${error.code ? ` ${error.code}` : ""}: ${error.message}`;
  box.dataset.status = error.status || "";
  box.hidden = false;
}

// Server-Sent Events read from a fetch (EventSource cannot send the Authorization header): onEvent(name, data)
export async function readEvents(path, onEvent, signal) {
  const response = await api(path, { signal, headers: { Accept: "text/event-stream" } });
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
      }
      if (data.length) {
        if (onEvent(name, JSON.parse(data.join("\n"))) === false) { reader.cancel(); return; }
      }
    }
  }
}

// The MIME type of an fMP4 from its init segment: avc1.PPCCLL read from the avcC box (profile, compatibility, level)
export function mp4Type(bytes) {
  for (let i = 4; i + 8 < bytes.length; i++) {
    if (bytes[i] === 0x61 && bytes[i + 1] === 0x76 && bytes[i + 2] === 0x63 && bytes[i + 3] === 0x43) {
      const hex = (b) => b.toString(16).padStart(2, "0");
      return `video/mp4; codecs="avc1.${hex(bytes[i + 5])}${hex(bytes[i + 6])}${hex(bytes[i + 7])}"`;
    }
  }
  return 'video/mp4; codecs="avc1.42E01E"';
}

// A MediaSource fed with fMP4 pieces in order (sequence mode: a dropped fragment leaves no gap to stall on)
export class MediaFeed {
  constructor(video) {
    this.video = video;
    this.queue = [];
    this.buffer = null;
    this.ended = false;
    this.source = new MediaSource();
    this.url = URL.createObjectURL(this.source);
    video.src = this.url;
    this.opened = new Promise((resolve) => this.source.addEventListener("sourceopen", resolve, { once: true }));
  }

  async push(bytes) {
    await this.opened;
    if (this.buffer === null) {
      this.buffer = this.source.addSourceBuffer(mp4Type(bytes));
      this.buffer.mode = "sequence";
      this.buffer.addEventListener("updateend", () => this.pump());
    }
    this.queue.push(bytes);
    this.pump();
  }

  pump() {
    if (!this.buffer || this.buffer.updating) return;
    if (this.queue.length) {
      this.buffer.appendBuffer(this.queue.shift());
    } else if (this.ended && this.source.readyState === "open") {
      this.source.endOfStream();
    }
  }

  end() {
    this.ended = true;
    this.pump();
  }

  close() {
    URL.revokeObjectURL(this.url);
  }
}
