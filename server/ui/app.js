// The page's finite-video half: the form built from the model's capabilities, progress from the SSE stream, the
// video playing as it streams (?stream=true) and the recent list (cancel, delete, download). live.js: live sessions.

import { api, apiKey, MediaFeed, readEvents, setApiKey, showError } from "./api.js";
import { setupLive } from "./live.js";

const $ = (id) => document.getElementById(id);
const state = { model: null, watching: null };
window.longserve = state;             // read by the browser tests (and handy in the console)

async function loadModel() {
  showError(null);
  try {
    const models = await (await api("/v1/models")).json();
    const card = models.data.find((m) => m.kind === "video");
    state.model = await (await api(`/v1/models/${encodeURIComponent(card.id)}`)).json();
  } catch (e) {
    $("model").textContent = "not connected";
    showError(e);
    return;
  }
  const m = state.model;
  const caps = m.capabilities;
  $("model").textContent = `${m.id} (${m.family})`;
  const form = $("create");
  form.size.placeholder = m.defaults.size;
  form.seconds.placeholder = m.defaults.seconds ?? "";
  form.num_inference_steps.placeholder = m.defaults.num_inference_steps;
  for (const el of document.querySelectorAll("[data-needs]")) {
    const rule = caps[el.dataset.needs];
    el.hidden = !rule || rule === "refused";
    const input = el.querySelector("input");
    if (input) input.required = rule === "required" && !el.closest("#live");
  }
  $("live").hidden = !caps.live;
  document.body.dataset.ready = "true";
  await refreshRecent();
}

function formBody(form) {
  const data = new FormData();
  for (const el of form.elements) {
    if (!el.name || el.closest("[hidden]")) continue;
    if (el.type === "file") { if (el.files.length) data.append(el.name, el.files[0]); continue; }
    if (el.value.trim() !== "") data.append(el.name, el.value.trim());
  }
  return data;
}

async function generate(event) {
  event.preventDefault();
  showError(null);
  let video;
  try {
    video = await (await api("/v1/videos", { method: "POST", body: formBody($("create")) })).json();
  } catch (e) { showError(e); return; }
  watch(video.id);
  refreshRecent();
}

function setProgress(value, text) {
  $("progress").value = value;
  $("progress-text").textContent = text;
}

async function watch(id) {
  if (state.watching) state.watching.abort();
  const control = new AbortController();
  state.watching = control;
  state.current = { id, status: "queued", streamed: false };
  setProgress(0, "queued");
  streamContent(id, control.signal);
  try {
    await readEvents(`/v1/videos/${id}/events`, (name, data) => {
      if (name === "error") { showError({ message: data.error.message, code: data.error.code }); return false; }
      state.current.status = data.status || state.current.status;
      const progress = Math.round(data.progress ?? 0);
      if (name === "video.queued") setProgress(0, `queued (position ${data.queue_position})`);
      else if (name === "video.progress") setProgress(progress, `step ${data.step}/${data.num_steps}`);
      else if (name === "video.decoding") setProgress(progress, `decoding ${data.frames_done}/${data.num_frames}`);
      else if (name === "video.completed") { setProgress(100, "completed"); finished(id); return false; }
      else if (name === "video.failed") {
        setProgress(progress, "failed");
        showError({ message: data.error ? data.error.message : "the video failed", code: data.error?.code });
        return false;
      } else if (name === "video.deleted") { setProgress(0, "deleted"); return false; }
      else setProgress(progress, data.status || name);
      return true;
    }, control.signal);
  } catch (e) {
    if (e.name !== "AbortError") showError(e);
  }
  refreshRecent();
}

// the MP4 while it is made: fragments into a MediaSource as they come
async function streamContent(id, signal) {
  const video = $("video");
  try {
    const response = await api(`/v1/videos/${id}/content?stream=true`, { signal });
    if (response.status !== 200) return;
    const feed = new MediaFeed(video);
    state.current.feed = feed;
    video.play().catch(() => {});
    const reader = response.body.getReader();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      await feed.push(value);
    }
    feed.end();
    state.current.streamed = true;
  } catch (e) {
    if (e.name !== "AbortError" && e.status !== 409) showError(e);
  }
}

// done: the stored file, looping (a stream that did not play is replaced by it)
async function finished(id) {
  await new Promise((resolve) => setTimeout(resolve, 50));
  const video = $("video");
  if (state.current.streamed && video.readyState >= 2) return;
  try {
    const blob = await (await api(`/v1/videos/${id}/content`)).blob();
    if (state.current.feed) state.current.feed.close();
    video.src = URL.createObjectURL(blob);
    video.play().catch(() => {});
  } catch (e) { showError(e); }
}

async function refreshRecent() {
  let page;
  try { page = await (await api("/v1/videos?limit=10")).json(); } catch (e) { showError(e); return; }
  const body = $("recent").querySelector("tbody");
  body.replaceChildren(...page.data.map(row));
}

function button(label, action) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.dataset.action = label;
  b.addEventListener("click", async () => {
    try { await action(); } catch (e) { showError(e); }
    refreshRecent();
  });
  return b;
}

function row(v) {
  const tr = document.createElement("tr");
  tr.dataset.id = v.id;
  const cells = [v.id.slice(0, 14), v.prompt || "", `${v.status}${v.progress != null && v.status !== "completed"
    ? ` ${Math.round(v.progress)}%` : ""}`].map((text) => {
    const td = document.createElement("td");
    td.textContent = text;                                  // text, never HTML: a prompt is the client's data
    return td;
  });
  const actions = document.createElement("td");
  const running = v.status === "queued" || v.status === "in_progress";
  if (v.status === "completed") {
    actions.append(button("play", () => watch(v.id)), button("download", () => download(v.id)));
    if (state.model && state.model.capabilities.video !== "refused") actions.append(button("extend", () => extend(v.id)));
  } else if (running) {
    actions.append(button("watch", () => watch(v.id)));
  }
  actions.append(button(running ? "cancel" : "delete", () => api(`/v1/videos/${v.id}`, { method: "DELETE" })));
  tr.append(...cells, actions);
  return tr;
}

// a diffusion-forcing model continues a completed video: the form's prompt and seconds, as a new video
async function extend(id) {
  const form = $("create");
  const body = { prompt: form.prompt.value };
  if (form.seconds.value.trim()) body.seconds = form.seconds.value.trim();
  const video = await (await api(`/v1/videos/${id}/extend`, {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  })).json();
  watch(video.id);
}

async function download(id) {
  const blob = await (await api(`/v1/videos/${id}/content`)).blob();
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = `${id}.mp4`;
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

function main() {
  const key = $("api-key");
  key.value = apiKey();
  key.addEventListener("change", () => { setApiKey(key.value.trim()); loadModel(); });
  $("key-form").addEventListener("submit", (e) => { e.preventDefault(); setApiKey(key.value.trim()); loadModel(); });
  $("create").addEventListener("submit", generate);
  $("refresh").addEventListener("click", refreshRecent);
  setupLive(state);
  loadModel();
}

main();
