// The page's finite-video half: the form built from the model's capabilities and settings, progress from the SSE
// stream (the job's one progress state: the same the history shows), the video playing as it streams
// (?stream=true). history.js: the history; live.js: live sessions.

import { api, apiKey, MediaFeed, readEvents, setApiKey, showError } from "./api.js";
import { setupHistory, stateText, timeText } from "./history.js";
import { setupLive } from "./live.js";

const $ = (id) => document.getElementById(id);
const state = { model: null, watching: null };
window.longserve = state;             // read by the browser tests (and handy in the console)
const history = setupHistory(state, { watch: (id) => watch(id), extend: (id) => extend(id) });

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
  const d = m.defaults;                          // the model's settings: what a field left empty gets
  form.size.placeholder = d.size;
  form.fps.placeholder = d.fps ?? "";
  form.num_inference_steps.placeholder = d.num_inference_steps;
  form.guidance_scale.placeholder = d.guidance_scale ?? "";
  const lengthHint = () => {
    form.length.placeholder = form.length_unit.value === "seconds" ? (d.seconds ?? "") : d.num_frames;
  };
  form.length_unit.onchange = lengthHint;
  lengthHint();
  $("live-form").size.placeholder = d.size;
  for (const el of document.querySelectorAll("[data-needs]")) {
    const rule = caps[el.dataset.needs];
    el.hidden = !rule || rule === "refused";
    const input = el.querySelector("input");
    if (input) input.required = rule === "required" && !el.closest("#live");
  }
  $("live").hidden = !caps.live;
  document.body.dataset.ready = "true";
  await history.refresh();
}

function formBody(form) {
  const data = new FormData();
  for (const el of form.elements) {
    if (!el.name || el.closest("[hidden]")) continue;
    if (el.type === "file") { if (el.files.length) data.append(el.name, el.files[0]); continue; }
    if (el.name === "length_unit") continue;
    const name = el.name === "length" ? form.length_unit.value : el.name;      // seconds, or num_frames
    if (el.value.trim() !== "") data.append(name, el.value.trim());
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
  history.refresh();
}

// the job's progress state (`state` of the API's events and Video objects) on the progress line and its row
function showState(id, status, state) {
  if (!state) return;
  $("progress").value = state.stage === "completed" ? 100 : state.percent;
  $("progress-text").textContent = stateText(state);
  $("progress-time").textContent = timeText(state);
  state.id = id;
  window.longserve.progress = state;
  history.update(id, status, state);
}

async function watch(id) {
  if (state.watching) state.watching.abort();
  const control = new AbortController();
  state.watching = control;
  state.current = { id, status: "queued", streamed: false };
  $("video").hidden = false;                      // (no empty player before the first video)
  showState(id, "queued", { stage: "queued", percent: 0 });
  streamContent(id, control.signal);
  try {
    await readEvents(`/v1/videos/${id}/events`, (name, data) => {
      if (name === "error") { showError({ message: data.error.message, code: data.error.code }); return false; }
      state.current.status = data.status || state.current.status;
      showState(id, data.status, data.state);
      if (name === "video.completed") { finished(id); return false; }
      if (name === "video.failed") {
        showError({ message: data.error ? data.error.message : "the video failed", code: data.error?.code });
        return false;
      }
      if (name === "video.deleted") {
        $("progress").value = 0;
        $("progress-text").textContent = "deleted";
        return false;
      }
      return true;
    }, control.signal);
  } catch (e) {
    if (e.name !== "AbortError") showError(e);
  }
  history.refresh();
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

function main() {
  const key = $("api-key");
  key.value = apiKey();
  key.addEventListener("change", () => { setApiKey(key.value.trim()); loadModel(); });
  $("key-form").addEventListener("submit", (e) => { e.preventDefault(); setApiKey(key.value.trim()); loadModel(); });
  $("create").addEventListener("submit", generate);
  setupLive(state, history);
  loadModel();
}

main();
