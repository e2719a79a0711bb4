// The dashboard page: reads /api/status and /api/history every second and
// redraws.  Every value from the store is set as text, never as HTML.
"use strict";

const SPAN = 900;
const state = { meta: null, after: null, points: {}, to: 0, updates: 0, showIdle: null };

function el(tag, attrs, ...kids) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "text") node.textContent = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else if (k === "onclick") node.addEventListener("click", v);
    else node.setAttribute(k, v);
  }
  for (const kid of kids) if (kid !== null && kid !== undefined) node.append(kid);
  return node;
}

async function getJSON(url) {
  const reply = await fetch(url, { cache: "no-store" });
  const body = await reply.json();
  if (!reply.ok) throw new Error(body.error || reply.statusText);
  return body;
}

function span(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  if (seconds >= 3600) return `${Math.floor(seconds / 3600)}h${String(Math.floor(seconds % 3600 / 60)).padStart(2, "0")}m`;
  if (seconds >= 60) return `${Math.floor(seconds / 60)}m${String(Math.floor(seconds % 60)).padStart(2, "0")}s`;
  return `${seconds.toFixed(1)}s`;
}

// --- the table -------------------------------------------------------------

function fillCell(r) {
  if ("held" in r) {
    return el("td", { "data-field": "fill" }, `${r.held}/${r.concurrency} seats`,
      el("div", { class: "small", text: `average run ${r.average_run_s.toFixed(2)}s` }));
  }
  if (!("fill" in r)) return el("td", { "data-field": "fill", text: r.note || "-" });
  const bar = el("span", { class: "bar" }, el("span", { style: `width:${Math.round(r.fill * 100)}%` }));
  return el("td", { "data-field": "fill" }, bar, `${Math.round(r.fill * 100)}%`,
    el("div", { class: "small", text: `${r.used} of ${r.burst} used` }));
}

function nextCell(r) {
  const td = el("td", { "data-field": "next" });
  if (r.stopped) {
    td.append(el("span", { class: "paused", "data-field": "paused",
      text: "stopped until resumed: the provider says the money is spent" }));
    td.append(el("div", { class: "small", "data-field": "stopped", text: r.stopped.message }));
    return td;
  }
  if (r.paused_s) {
    const who = r.paused_by === "operator" ? "by an operator" : "after a provider's 429";
    td.append(el("span", { class: "paused", "data-field": "paused",
      text: `paused ${span(r.paused_s)} (${who})` }));
    return td;
  }
  if ("held" in r) td.append(r.held < r.concurrency ? "now" : "when a run ends");
  else if ("next_free_s" in r) td.append(r.next_free_s === 0 ? "now" : `in ${r.next_free_s.toFixed(3)}s`);
  else td.append("-");
  const held = r.held_by_provider;
  if (held) {
    td.append(el("div", { class: "held",
      text: `held: the provider reported ${held.remaining} left until its reset in ${held.until_reset_s.toFixed(1)}s` }));
  }
  return td;
}

function waitingCell(r) {
  const waiting = (r.in_line || 0) + (r.booked_ahead || 0);
  const td = el("td", { "data-field": "waiting", "data-waiting": String(waiting) });
  td.append(String(waiting));
  const parts = [];
  if (r.in_line) parts.push(`${r.in_line} in line`);
  if (r.booked_ahead) parts.push(`${r.booked_ahead} booked`);
  if (r.drains_in_s !== undefined && r.drains_in_s !== null) parts.push(`drains in ~${span(r.drains_in_s)}`);
  if (parts.length) td.append(el("div", { class: "small", text: parts.join(", ") }));
  const sh = r.shadow;
  if (sh) {
    td.append(el("div", { class: "held", "data-field": "shadow",
      text: `shadow: would have deferred ${sh.would_defer_15m} in 15 min` +
        (sh.would_next_free_s ? `, would drain in ${span(sh.would_next_free_s)}` : "") }));
  }
  return td;
}

function controlsCell(r) {
  const name = r.limit;
  const td = el("td", { class: "controls" });
  if (r.paused_s) td.append(el("button", { text: "Resume", onclick: () => act(name, "resume", {}) }));
  else td.append(el("button", { text: "Pause…", onclick: () => {
    // A per-key limit is paused for one key value (typed here, never shown back).
    const key = r.per_key ? prompt(`Pause ${name} for which key value?`, "") : null;
    if (r.per_key && !key) return;
    const s = prompt(`Pause ${name} for how many seconds? (empty: until resumed)`, "");
    if (s === null) return;
    act(name, "pause", { seconds: s.trim() === "" ? null : Number(s), key });
  } }));
  if ("rate" in r) {
    td.append(el("button", { text: "Set rate…", onclick: () => {
      const rate = prompt(`New rate for ${name} (e.g. 20/s, 300/m)`, r.rate);
      if (rate) act(name, "set", { rate: rate.trim() });
    } }));
    if ("code_rate" in r) td.append(el("button", { text: "Unset", onclick: () => act(name, "unset", {}) }));
  }
  if ((r.in_line || 0) + (r.booked_ahead || 0) > 0) {
    td.append(el("button", { text: "Purge…", onclick: () => {
      const typed = prompt(`Every task waiting for ${name} is revoked and never runs. Type the limit's name to confirm:`);
      if (typed === name) act(name, "purge", { confirm: name });
    } }));
  }
  td.append(el("button", { text: r.enforced === false ? "Enforce" : "Shadow",
    onclick: () => act(name, "shadow", { mode: r.enforced === false ? "off" : "on" }) }));
  return td;
}

// A limit that learns its provider's quota: the rate it decides at, and its last move.
function learnedText(l) {
  const rate = (n) => `${Number(n.toPrecision(4))}/s`;
  return `learned ${rate(l.rate_per_s)}` +
    (l.moved ? ` (${l.moved} ${Math.round(l.moved_s_ago)}s ago from ${rate(l.before_per_s)})` : "");
}

function renderStatus(doc) {
  const body = document.getElementById("limits");
  // The busiest first: tasks waiting, then paused, then fill; idle limits last.
  const weight = (r) => ((r.in_line || 0) + (r.booked_ahead || 0)) * 1e6 +
    (r.shadow ? 1e4 : 0) +
    (r.paused_s ? 1e5 : 0) + (r.fill || 0) * 1e3 + ("held" in r ? r.held : 0);
  const sorted = [...doc.limits].sort((a, b) => weight(b) - weight(a));
  const rows = sorted.map((r) => {
    let rate = "rate" in r ? `${r.rate} (burst ${r.burst})` : `${r.concurrency} at once`;
    const tr = el("tr", { class: "limit", "data-limit": r.limit },
      el("td", {}, el("b", { text: r.limit }), r.per_key ? el("div", { class: "small", text: "per key" }) : null,
        r.enforced === false ? el("div", { class: "held", text: `shadow mode (${r.enforced_by})` }) : null),
      el("td", { "data-field": "rate" }, rate,
        "code_rate" in r ? el("div", { class: "small", text: `set live; the code says ${r.code_rate} burst ${r.code_burst}` }) : null,
        r.learned ? el("div", { class: "small", "data-field": "learned", text: learnedText(r.learned) }) : null),
      fillCell(r), nextCell(r), waitingCell(r),
      el("td", { class: "small", text: (r.top_keys || []).filter((k) => k.key_digest !== "-")
        .map((k) => `key ${k.key_digest.slice(0, 8)}…: ${k.waiting}`).join("\n") || "-" }),
      el("td", { class: "small", text: r.used_by.join(", ") }));
    if (state.meta && state.meta.controls) tr.append(controlsCell(r));
    if (weight(r) === 0 && !state.showIdle) tr.hidden = true;
    return tr;
  });
  body.replaceChildren(...rows);
  // Many limits: the idle ones are folded away (still in the page, for a search).
  if (state.showIdle === null) state.showIdle = doc.limits.length <= 8;
  const idle = doc.limits.filter((r) => weight(r) === 0).length;
  const toggle = document.getElementById("idle");
  toggle.hidden = idle === 0;
  toggle.textContent = state.showIdle ? `hide ${idle} idle limit(s)` : `show ${idle} idle limit(s)`;
  const room = doc.waiting_room;
  const next = room.next_dispatch === null ? "" : `; next dispatch in ${room.next_dispatch.toFixed(3)}s`;
  document.getElementById("room").textContent =
    `waiting room: ${room.parked} parked, ${doc.in_line} in line, ${room.dispatching} on their way${next}` +
    (room.in_use ? "" : ` (not used: ${room.because})`);
  document.getElementById("updated").textContent = `updated ${new Date(doc.at * 1000).toLocaleTimeString()}`;
}

// --- the charts ------------------------------------------------------------

const SERIES = [
  ["admitted", "starts/s", "#2f7ed8"], ["limit_per_s", "limit", "#b42318"],
  ["deferred", "deferrals/s", "#f79009"], ["would_defer", "would-have deferrals/s (shadow)", "#9e77ed"],
  ["provider_pauses", "429 pauses", "#7a2e0e"],
];

function mergeHistory(h) {
  for (const [name, series] of Object.entries(h.limits)) {
    const mine = state.points[name] || (state.points[name] = {});
    for (const [field, values] of Object.entries(series)) {
      const m = mine[field] || (mine[field] = new Map());
      values.forEach((v, i) => { if (v === null) m.delete(h.from + i); else m.set(h.from + i, v); });
      for (const s of m.keys()) if (s <= h.to - SPAN) m.delete(s);
    }
  }
  state.to = h.to;
  state.after = h.to;
}

// The seconds charted: from the first with anything to show (at least 2 minutes,
// at most 15), so a fresh run is not a sliver at the right edge.
function windowSeconds() {
  let earliest = state.to;
  for (const series of Object.values(state.points)) {
    for (const m of Object.values(series)) {
      for (const [s, v] of m) if (v && s < earliest) earliest = s;
    }
  }
  return Math.min(SPAN, Math.max(120, state.to - earliest + 10));
}

function path(m, from, w, h, top, width) {
  let d = "";
  for (let s = from; s <= state.to; s++) {
    if (!m || !m.has(s)) continue;
    const x = (s - from) / width * w, y = h - Math.min(m.get(s), top) / top * h;
    d += `${d === "" ? "M" : "L"}${x.toFixed(1)},${y.toFixed(1)}`;
  }
  return d;
}

function chart(name, series, width) {
  const w = 440, h = 90, from = state.to - width + 1, ns = "http://www.w3.org/2000/svg";
  const svgs = [];
  const rateTop = Math.max(1, ...["admitted", "limit_per_s", "deferred", "would_defer"].flatMap((f) => [...(series[f] || new Map()).values()])) * 1.1;
  const waitTop = Math.max(1, ...(series.waiting || new Map()).values()) * 1.1;
  for (const [top, fields, title] of [[rateTop, SERIES, "per second"], [waitTop, [["waiting", "tasks waiting", "#475467"]], "tasks waiting"]]) {
    const svg = document.createElementNS(ns, "svg");
    svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
    svg.setAttribute("width", "100%");
    svg.setAttribute("data-chart", `${name}:${title}`);
    for (const [field, , color] of fields) {
      const m = series[field];
      if (field === "provider_pauses") {
        for (const [s, v] of (m || new Map())) {
          if (!v) continue;
          const line = document.createElementNS(ns, "line");
          if (s < from) continue;
          const x = ((s - from) / width * w).toFixed(1);
          for (const [k, val] of [["x1", x], ["x2", x], ["y1", 0], ["y2", h], ["stroke", color], ["stroke-width", 2]]) line.setAttribute(k, val);
          svg.append(line);
        }
        continue;
      }
      const p = document.createElementNS(ns, "path");
      p.setAttribute("d", path(m, from, w, h, top, width));
      p.setAttribute("fill", "none");
      p.setAttribute("stroke", color);
      p.setAttribute("stroke-width", "1.5");
      if (field === "limit_per_s") p.setAttribute("stroke-dasharray", "4 3");
      svg.append(p);
    }
    svgs.push(el("div", { class: "small", text: `${title} (max ${top > 1.1 ? (top / 1.1).toFixed(1) : "-"})` }), svg);
  }
  const legend = el("div", { class: "legend" }, ...SERIES.concat([["waiting", "tasks waiting", "#475467"]]).map(
    ([, label, color]) => el("span", {}, el("i", { style: `background:${color}` }), label)));
  return el("div", { class: "chart", "data-limit": name },
    el("h3", { text: `${name}: the last ${span(width)}` }), legend, ...svgs);
}

function active(series) {
  // Anything but zeros and the limit line in the window: worth a chart.
  return ["admitted", "deferred", "would_defer", "provider_pauses", "waiting", "paused"].some(
    (f) => [...(series[f] || new Map()).values()].some((v) => v));
}

function renderCharts() {
  const names = Object.keys(state.points).sort();
  const shown = names.filter((n) => active(state.points[n]));
  const idle = names.length - shown.length;
  const width = windowSeconds();
  document.getElementById("charts").replaceChildren(...shown.map((n) => chart(n, state.points[n], width)),
    ...(idle ? [el("div", { class: "small", text: `${idle} limit(s) idle for 15 minutes: not charted` })] : []));
}

// --- controls ----------------------------------------------------------------

function secret() {
  let token = sessionStorage.getItem("throttle-token");
  if (!token) {
    token = prompt("The dashboard's secret (--token):");
    if (token) sessionStorage.setItem("throttle-token", token);
  }
  return token;
}

async function post(url, body) {
  const token = secret();
  if (!token) return;
  const reply = await fetch(url, { method: "POST", body: JSON.stringify(body),
    headers: { "Content-Type": "application/json", Authorization: `Bearer ${token}` } });
  const answer = await reply.json();
  if (reply.status === 401) sessionStorage.removeItem("throttle-token");
  if (!reply.ok) alert(answer.error || reply.statusText);
  refresh();
}

function act(name, action, body) {
  return post(`/api/limits/${encodeURIComponent(name)}/${action}`, body);
}

document.getElementById("idle").addEventListener("click", () => {
  state.showIdle = !state.showIdle;
  refresh();
});

document.getElementById("purge").addEventListener("click", () => {
  const typed = prompt("Every waiting task is dropped and never runs. Type purge to confirm:");
  if (typed === "purge") post("/api/purge", { confirm: "purge" });
});

document.getElementById("why").addEventListener("submit", async (event) => {
  event.preventDefault();
  const id = document.getElementById("why-id").value.trim();
  const out = document.getElementById("why-out");
  if (!id) return;
  try {
    const doc = await getJSON(`/api/why/${encodeURIComponent(id)}`);
    const w = doc.waiting;
    out.textContent = w === null
      ? `task ${id}: not waiting for the throttle (no deferral recorded in its last wait)`
      : `task ${id} (${w.task}) waits for limit ${w.limit}: next start in ${w.due_in_s.toFixed(3)}s; ` +
        `deferral ${w.deferrals}, waiting ${w.waiting_s.toFixed(1)}s so far` +
        (w.place !== undefined && w.place !== null ? `; number ${w.place + 1} in line` : "") +
        (w.booked ? "; start booked" : "");
  } catch (e) {
    out.textContent = String(e.message || e);
  }
});

// --- the loop ------------------------------------------------------------------

async function refresh() {
  try {
    if (state.meta === null) {
      state.meta = await getJSON("/api/meta");
      document.getElementById("app").textContent = `app ${state.meta.app}`;
      document.getElementById("store").textContent = `store ${state.meta.store}`;
      document.getElementById("mode").textContent = state.meta.controls ? "controls on" : "read-only";
      document.getElementById("purge").hidden = !state.meta.controls;
      for (const th of document.querySelectorAll("th.controls")) th.hidden = !state.meta.controls;
    }
    const [doc, hist] = await Promise.all([getJSON("/api/status"),
      getJSON(`/api/history${state.after === null ? "" : `?after=${state.after}`}`)]);
    renderStatus(doc);
    mergeHistory(hist);
    renderCharts();
    document.getElementById("error").textContent = "";
    state.updates += 1;
    document.body.dataset.updates = String(state.updates);
  } catch (e) {
    document.getElementById("error").textContent = `not updated: ${e.message || e}`;
  }
}

refresh();
setInterval(refresh, 1000);
