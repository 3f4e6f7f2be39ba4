// The page's history: the videos of this key, newest first, a page at a time (OpenAI's cursor: `after`), each with
// its thumbnail, its progress state (the same `state` the API gives every Video and SSE event: stage, percent,
// elapsed, ETA) and its actions (play, download, extend, cancel, delete). Live sessions recorded on the page are
// videos too, marked "live".

import { api, showError } from "./api.js";

const $ = (id) => document.getElementById(id);
export const PAGE_SIZE = 10;

// "step 4/79 · 12% · 3.2 s, about 20 s left": one text of a progress state, for the progress line and the rows
export function stateText(state) {
  if (!state) return "";
  const stage = {
    queued: state.queue_position != null ? `queued (position ${state.queue_position})` : "queued",
    denoising: state.step != null ? `step ${state.step}/${state.num_steps}` : "denoising",
    decoding: state.frames_done != null ? `decoding ${state.frames_done}/${state.num_frames}` : "decoding",
    in_progress: "in progress",
  }[state.stage] || state.stage;
  return stage;
}

export function timeText(state) {
  if (!state || state.elapsed_s == null) return "";
  // (a finished video's times are its record's whole seconds; a running one's, this moment's)
  const s = (x) => (x >= 60 ? `${Math.floor(x / 60)} min ${Math.round(x % 60)} s`
    : Number.isInteger(x) ? `${x} s` : `${x.toFixed(1)} s`);
  if (state.stage === "completed") return `in ${s(state.elapsed_s)}`;
  if (state.stage === "failed") return `after ${s(state.elapsed_s)}`;
  const eta = state.eta_s != null ? ` · about ${s(state.eta_s)} left` : "";
  return `${s(state.elapsed_s)}${eta}`;
}

export function setupHistory(page, actions) {
  const history = { cursors: [null], index: 0, hasMore: false, rows: new Map(), thumbs: new Map() };
  page.history = history;

  async function refresh() {
    let listing;
    const after = history.cursors[history.index];
    const query = `limit=${PAGE_SIZE}${after ? `&after=${encodeURIComponent(after)}` : ""}`;
    try { listing = await (await api(`/v1/videos?${query}`)).json(); } catch (e) { showError(e); return; }
    history.hasMore = listing.has_more;
    history.lastId = listing.last_id;
    history.rows = new Map(listing.data.map((v) => [v.id, v]));
    $("recent").querySelector("tbody").replaceChildren(...listing.data.map(row));
    $("older").disabled = !listing.has_more;
    $("newer").disabled = history.index === 0;
    $("page-info").textContent = `page ${history.index + 1}`;
    const active = listing.data.some((v) => v.status === "queued" || v.status === "in_progress");
    clearTimeout(history.timer);
    if (active) history.timer = setTimeout(refresh, 2000);   // the other running videos' states move too
  }

  // one video's state, as the page's SSE stream told it: its row shows what the progress line shows
  function update(id, status, state) {
    const tr = $("recent").querySelector(`tr[data-id="${CSS.escape(id)}"]`);
    if (!tr || !state) return;
    tr.querySelector("td.status").textContent = statusText({ status, state });
  }

  function statusText(v) {
    const state = v.state;
    if (!state) return v.status;
    const percent = state.stage === "completed" || state.stage === "failed" ? "" : ` · ${Math.round(state.percent)}%`;
    return `${stateText(state)}${percent} · ${timeText(state)}`;
  }

  function button(label, action) {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = label;
    b.dataset.action = label;
    b.addEventListener("click", async () => {
      try { await action(); } catch (e) { showError(e); }
      refresh();
    });
    return b;
  }

  // a thumbnail is fetched with the key (an <img> cannot send it) and kept for the page's life
  async function thumbnail(img, id) {
    try {
      let url = history.thumbs.get(id);
      if (!url) {
        url = URL.createObjectURL(await (await api(`/v1/videos/${id}/content?variant=thumbnail`)).blob());
        history.thumbs.set(id, url);
      }
      img.src = url;
    } catch { /* expired or gone: the cell stays grey */ }
  }

  function row(v) {
    const tr = document.createElement("tr");
    tr.dataset.id = v.id;
    const thumb = document.createElement("td");
    const img = document.createElement("img");
    img.className = "thumb";
    img.alt = "";
    thumb.append(img);
    if (v.status === "completed") thumbnail(img, v.id);
    const prompt = document.createElement("td");
    prompt.className = "prompt";
    if (v.options && v.options.live) {
      const badge = document.createElement("span");
      badge.className = "badge";
      badge.textContent = "live";
      prompt.append(badge);
    }
    prompt.append(v.prompt || "");                      // text, never HTML: a prompt is the client's data
    prompt.title = v.prompt || "";
    const status = document.createElement("td");
    status.className = "status";
    status.textContent = statusText(v);
    const cell = document.createElement("td");
    const running = v.status === "queued" || v.status === "in_progress";
    if (v.status === "completed") {
      cell.append(button("play", () => actions.watch(v.id)), button("download", () => download(v.id)));
      if (page.model && page.model.capabilities.video !== "refused") {
        cell.append(button("extend", () => actions.extend(v.id)));
      }
    } else if (running) {
      cell.append(button("watch", () => actions.watch(v.id)));
    }
    cell.append(button(running ? "cancel" : "delete", () => api(`/v1/videos/${v.id}`, { method: "DELETE" })));
    tr.append(thumb, prompt, status, cell);
    return tr;
  }

  async function download(id) {
    const blob = await (await api(`/v1/videos/${id}/content`)).blob();
    const a = document.createElement("a");
    a.href = URL.createObjectURL(blob);
    a.download = `${id}.mp4`;
    a.click();
    setTimeout(() => URL.revokeObjectURL(a.href), 1000);
  }

  $("refresh").addEventListener("click", refresh);
  $("older").addEventListener("click", () => {
    if (!history.hasMore) return;
    history.cursors = history.cursors.slice(0, history.index + 1).concat([history.lastId]);
    history.index += 1;
    refresh();
  });
  $("newer").addEventListener("click", () => {
    if (history.index === 0) return;
    history.index -= 1;
    refresh();
  });
  return { refresh, update };
}
