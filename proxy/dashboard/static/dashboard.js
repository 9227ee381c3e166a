// The Flywheel dashboard: polls the proxy's admin-only JSON API (/dashboard/api/, docs/dashboard.md)
// and draws it with plain DOM and inline SVG (charts.js); one session's drill-down is session_view.js.
// A module: strict, deferred, loaded from this origin only.
import {
  badge, colourOf, el, emptyChart, fmt, frame, padded, rollingMean, svg, timeLabel, titled, when,
} from "./charts.js";
import { renderSession } from "./session_view.js";

const KEY_STORAGE = "flywheel.dashboard.admin-key";
const POLL_MS = 5000;
const STATUS_COLOURS = { promoted: "#16a34a", rejected: "#dc2626", candidate: "#ca8a04" };

const state = {
  pages: [null],          // cursors of the sessions pages visited: the first page has none
  nextCursor: null,
  filters: {},
  openSession: null,
  timer: null,
  busy: false,
};

const $ = (id) => document.getElementById(id);

// ---- the API ----------------------------------------------------------------------------------

class AuthError extends Error {}

async function api(path, params) {
  const url = new URL(`/dashboard/api/${path}`, window.location.origin);
  for (const [name, value] of Object.entries(params || {})) {
    if (value !== undefined && value !== null && value !== "") url.searchParams.set(name, value);
  }
  const key = sessionStorage.getItem(KEY_STORAGE);
  const response = await fetch(url, { headers: { Authorization: `Bearer ${key}` }, cache: "no-store" });
  if (response.status === 401 || response.status === 403) {
    const body = await response.json().catch(() => ({}));
    throw new AuthError((body.error && body.error.message) || `HTTP ${response.status}`);
  }
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    throw new Error((body.error && body.error.message) || `HTTP ${response.status}`);
  }
  return response.json();
}

// ---- sign in and out --------------------------------------------------------------------------

function showSignedIn(signedIn) {
  $("login").hidden = signedIn;
  $("main").hidden = !signedIn;
  $("sign-out").hidden = !signedIn;
  $("live-label").hidden = !signedIn;
}

async function signIn(key) {
  sessionStorage.setItem(KEY_STORAGE, key);
  $("login-error").textContent = "Checking the key…";  // an earlier refusal must not read as this one's
  try {
    await api("summary");
  } catch (error) {
    sessionStorage.removeItem(KEY_STORAGE);
    $("login-error").textContent = error instanceof AuthError
      ? `Refused: ${error.message}` : `The proxy did not answer: ${error.message}`;
    showSignedIn(false);
    return;
  }
  $("login-error").textContent = "";
  showSignedIn(true);
  await refresh();
}

function signOut(message) {
  sessionStorage.removeItem(KEY_STORAGE);
  clearTimeout(state.timer);
  showSignedIn(false);
  $("login-error").textContent = message || "";
}

// ---- polling ----------------------------------------------------------------------------------

async function refresh() {
  clearTimeout(state.timer);
  if (state.busy) return;
  state.busy = true;
  const tasks = [loadSummary(), loadRewards(), loadVersions(), loadStaleness(), loadThroughput()];
  if (state.pages.length === 1) tasks.push(loadSessions());
  if (state.openSession) tasks.push(loadSession(state.openSession, false));
  const results = await Promise.allSettled(tasks);
  state.busy = false;
  const refused = results.find((r) => r.status === "rejected" && r.reason instanceof AuthError);
  if (refused) {
    signOut(`Signed out: ${refused.reason.message}`);
    return;
  }
  const failed = results.find((r) => r.status === "rejected");
  showError(failed ? `Some panels could not refresh: ${failed.reason.message}` : "");
  $("refreshed").textContent = `updated ${new Date().toLocaleTimeString()}`;
  schedule();
}

function schedule() {
  clearTimeout(state.timer);
  if ($("live").checked && sessionStorage.getItem(KEY_STORAGE)) {
    state.timer = setTimeout(() => { if (!document.hidden) refresh(); else schedule(); }, POLL_MS);
  }
}

// ---- summary ----------------------------------------------------------------------------------

async function loadSummary() {
  const s = await api("summary");
  const version = (v) => (v ? `v${v.version}` : "–");
  const cards = [
    ["served version", version(s.policy.served), s.policy.served && s.policy.served.eval_score !== null
      ? `eval ${fmt(s.policy.served.eval_score)}` : ""],
    ["best version", version(s.policy.best), s.policy.best && s.policy.best.eval_score !== null
      ? `eval ${fmt(s.policy.best.eval_score)}` : ""],
    ["newest version", version(s.policy.newest), s.policy.newest ? s.policy.newest.status : ""],
    ["trainer steps", fmt(s.trainer.steps), s.trainer.last_step_at ? `last ${when(s.trainer.last_step_at)}` : ""],
    ["sessions open", fmt(s.sessions.active), `${fmt(s.sessions.ended)} ended, ${fmt(s.sessions.finalized)} finalized`],
    ["completions", fmt(s.completions), s.last_completion_at ? `last ${when(s.last_completion_at)}` : ""],
    ["samples waiting", fmt(s.trajectories.unconsumed), `${fmt(s.trajectories.claimed)} claimed, ${fmt(s.trajectories.consumed)} trained, ${fmt(s.trajectories.dropped)} dropped`],
    ["hook jobs queued", fmt(s.reward_jobs.queued), `${fmt(s.reward_jobs.running)} running, ${fmt(s.reward_jobs.failed)} failed`],
  ];
  $("summary").replaceChildren(...cards.map(([label, value, detail]) => el("div", { className: "card" },
    el("div", { className: "label", text: label }), el("div", { className: "value", text: value }),
    el("div", { className: "detail", text: detail }))));
}

// ---- reward curves ----------------------------------------------------------------------------

async function loadRewards() {
  const doc = await api("rewards", {
    by: $("rewards-by").value, run: $("rewards-run").value.trim(), limit: $("rewards-limit").value,
  });
  const container = $("reward-chart");
  container.dataset.points = String(doc.points);
  const legend = $("reward-legend");
  if (!doc.points) {
    emptyChart(container, "No rewarded session yet.");
    legend.replaceChildren();
    return;
  }
  const times = doc.series.flatMap((s) => s.times);
  const rewards = doc.series.flatMap((s) => s.rewards);
  const span = Math.max(...times) - Math.min(...times);
  const chart = frame(container, padded(Math.min(...times), Math.max(...times)),
    padded(Math.min(...rewards), Math.max(...rewards)),
    { label: "reward per session over time", xLabel: (t) => timeLabel(t, span) });
  doc.series.forEach((series, index) => {
    const colour = colourOf(index);
    const group = svg("g", { class: "series", "data-key": series.key === null ? "" : series.key });
    series.times.forEach((t, i) => {
      group.append(titled(svg("circle", {
        class: "point", cx: chart.x(t), cy: chart.y(series.rewards[i]), r: 3, fill: colour,
        "data-session": series.sessions[i],
      }), `${series.sessions[i]}: ${fmt(series.rewards[i])} at ${new Date(t * 1000).toLocaleString()}`));
    });
    if (series.rewards.length > 2) {
      const window = Math.max(3, Math.round(series.rewards.length / 10));
      const mean = rollingMean(series.rewards, window);
      const points = series.times.map((t, i) => `${chart.x(t).toFixed(1)},${chart.y(mean[i]).toFixed(1)}`);
      group.append(svg("polyline", { class: "mean", points: points.join(" "), stroke: colour }));
    }
    chart.root.append(group);
  });
  container.replaceChildren(chart.root);
  legend.replaceChildren(...doc.series.map((series, index) => el("span", { className: "item" },
    el("span", { className: "swatch", dataset: { colour: colourOf(index) } }),
    `${series.label === null ? "(none)" : series.label}: ${series.count} sessions, mean ${fmt(series.mean)}, last ${fmt(series.last)}`)));
  legend.querySelectorAll(".swatch").forEach((swatch) => { swatch.style.background = swatch.dataset.colour; });
  if (doc.other_series) legend.append(el("span", { className: "muted", text: `+${doc.other_series} more series` }));
}

// ---- policy versions --------------------------------------------------------------------------

async function loadVersions() {
  const doc = await api("versions", { limit: 200 });
  const rows = doc.versions.map((v) => el("tr", { dataset: { version: v.version } },
    el("td", {}, `v${v.version}`, v.is_served ? " ▶" : "", v.is_best ? " ★" : ""),
    el("td", {}, badge(v.status)),
    el("td", { text: v.parent_version === null ? "–" : `v${v.parent_version}` }),
    el("td", { className: "num", text: fmt(v.eval_score) }),
    el("td", { className: "num", text: fmt(v.metrics["reward/mean"]) }),
    el("td", { className: "num", text: fmt(v.metrics["staleness/mean"]) }),
    el("td", { text: when(v.created_at) }),
    el("td", { className: "wrap", text: v.reason || "" })));
  $("versions-table").tBodies[0].replaceChildren(...rows);
  const scored = doc.versions.filter((v) => v.eval_score !== null);
  const container = $("eval-chart");
  if (!scored.length) {
    emptyChart(container, "No evaluated version yet (▶ served, ★ best).");
    return;
  }
  const xs = scored.map((v) => v.version);
  const ys = scored.map((v) => v.eval_score);
  const chart = frame(container, padded(Math.min(...xs), Math.max(...xs)), padded(Math.min(...ys), Math.max(...ys)),
    { height: 180, label: "eval score per version", xLabel: (v) => (Number.isInteger(v) ? `v${v}` : "") });
  const ordered = [...scored].sort((a, b) => a.version - b.version);
  chart.root.append(svg("polyline", { class: "line", stroke: "#9aa1ad",
    points: ordered.map((v) => `${chart.x(v.version)},${chart.y(v.eval_score)}`).join(" ") }));
  for (const v of ordered) {
    chart.root.append(titled(svg("circle", { class: "point", cx: chart.x(v.version), cy: chart.y(v.eval_score),
      r: v.is_served ? 5 : 3.5, fill: STATUS_COLOURS[v.status] || "#64748b", "data-status": v.status }),
    `v${v.version} ${v.status}: eval ${fmt(v.eval_score)}`));
  }
  container.replaceChildren(chart.root);
}

// ---- staleness --------------------------------------------------------------------------------

async function loadStaleness() {
  const doc = await api("staleness");
  $("staleness-note").textContent = `Versions behind: trained samples at their step (last ${doc.steps} steps), `
    + `waiting samples against v${doc.current_version}.`;
  const container = $("staleness-chart");
  const lags = Math.max(doc.trained.length, doc.waiting.length);
  if (!lags) {
    emptyChart(container, "No trajectory yet.");
    return;
  }
  const counts = [...doc.trained, ...doc.waiting].map((b) => b.count);
  const chart = frame(container, [-0.5, lags - 0.5], [0, Math.max(...counts, 1) * 1.08], {
    height: 180, label: "samples by staleness", xTicks: [...Array(lags).keys()],
    xLabel: (lag) => {
      const bucket = doc.trained[lag] || doc.waiting[lag];
      return bucket && bucket.or_more ? `≥${lag}` : String(lag);
    },
  });
  const slot = (chart.x(1) - chart.x(0)) * 0.8;
  [["trained", doc.trained, 0], ["waiting", doc.waiting, 1]].forEach(([kind, buckets, side]) => {
    for (const bucket of buckets) {
      if (!bucket.count) continue;
      const left = chart.x(bucket.lag) - slot / 2 + side * (slot / 2);
      chart.root.append(titled(svg("rect", { class: `bar ${kind}`, x: left, width: slot / 2,
        y: chart.y(bucket.count), height: chart.y(0) - chart.y(bucket.count), "data-lag": bucket.lag }),
      `${kind}: ${bucket.count} samples ${bucket.or_more ? "≥ " : ""}${bucket.lag} versions behind`));
    }
  });
  container.replaceChildren(chart.root);
}

// ---- throughput -------------------------------------------------------------------------------

async function loadThroughput() {
  const doc = await api("throughput");
  const label = (seconds) => (seconds < 3600 ? `${seconds / 60} min` : `${seconds / 3600} h`);
  $("throughput-table").tBodies[0].replaceChildren(...doc.windows.map((w) => el("tr", {},
    el("td", { text: `last ${label(w.seconds)}` }),
    el("td", { className: "num", text: fmt(w.completions_per_s) }),
    el("td", { className: "num", text: fmt(w.tokens_per_s) }),
    el("td", { className: "num", text: fmt(w.hook_jobs_per_s) }),
    el("td", { className: "num", text: fmt(w.trajectories_per_s) }))));
  const series = doc.series;
  const start = Date.parse(series.start) / 1000;
  const n = series.completions.length;
  const rate = (counts) => counts.map((c) => c / series.bucket_s);
  const completions = rate(series.completions);
  const hooks = rate(series.hook_jobs);
  const top = Math.max(...completions, ...hooks, 0.001);
  const end = start + n * series.bucket_s;
  const chart = frame($("throughput-chart"), [start, end], [0, top * 1.1],
    { height: 180, label: "completions and hook jobs per second", xLabel: (t) => timeLabel(t, end - start) });
  const mid = (i) => start + (i + 0.5) * series.bucket_s;
  for (const [values, colour] of [[completions, "#2563eb"], [hooks, "#db2777"]]) {
    chart.root.append(svg("polyline", { class: "line", stroke: colour,
      points: values.map((v, i) => `${chart.x(mid(i)).toFixed(1)},${chart.y(v).toFixed(1)}`).join(" ") }));
  }
  $("throughput-chart").replaceChildren(chart.root);
}

// ---- sessions table ---------------------------------------------------------------------------

function readFilters() {
  const form = new FormData($("session-filters"));
  const filters = {};
  for (const [name, value] of form.entries()) {
    const text = String(value).trim();
    if (!text) continue;
    filters[name] = (name === "since" || name === "until") ? new Date(text).toISOString() : text;
  }
  return filters;
}

async function loadSessions() {
  const cursor = state.pages[state.pages.length - 1];
  const doc = await api("sessions", { ...state.filters, cursor });
  state.nextCursor = doc.next_cursor;
  const rows = doc.sessions.map((s) => {
    const row = el("tr", { dataset: { session: s.session_id }, onclick: () => openSession(s.session_id) },
      el("td", { className: "mono", text: s.session_id }),
      el("td", {}, badge(s.status)),
      el("td", { text: s.run === null ? "–" : s.run }),
      el("td", { className: "wrap", text: s.task ? s.task.text : "–" }),
      el("td", { text: when(s.created_at) }),
      el("td", { className: "num", text: fmt(s.completions) }),
      el("td", { className: "num", text: fmt(s.output_tokens) }),
      el("td", { className: "num", text: fmt(s.trajectories) }),
      el("td", { className: "num", text: fmt(s.reward) }));
    if (s.session_id === state.openSession) row.classList.add("selected");
    return row;
  });
  $("sessions-table").tBodies[0].replaceChildren(...rows);
  $("newer-page").disabled = state.pages.length === 1;
  $("older-page").disabled = !doc.next_cursor;
  $("page-info").textContent = `page ${state.pages.length}: ${doc.sessions.length} sessions`
    + (doc.sessions.length ? "" : " (none matched)");
}

// ---- one session ------------------------------------------------------------------------------

async function openSession(sessionId) {
  state.openSession = sessionId;
  document.querySelectorAll("#sessions-table tr.selected").forEach((row) => row.classList.remove("selected"));
  const row = document.querySelector(`#sessions-table tr[data-session="${CSS.escape(sessionId)}"]`);
  if (row) row.classList.add("selected");
  try {
    await loadSession(sessionId, true);
  } catch (error) {
    if (error instanceof AuthError) signOut(`Signed out: ${error.message}`);
    else showError(`Session ${sessionId} could not be read: ${error.message}`);
  }
}

function showError(message) {
  $("api-error").hidden = !message;
  $("api-error").textContent = message || "";
}

// `view` of session_view.js: the "show more" button's page of tokens, and where its failure shows.
const sessionView = {
  moreTokens: (completionId, offset) => api(`completions/${encodeURIComponent(completionId)}/tokens`,
    { offset, limit: 1024 }),
  showError,
};

async function loadSession(sessionId, scroll) {
  const detail = $("session-detail");
  const expanded = detail.dataset.session === sessionId && !scroll;
  if (expanded && detail.dataset.status === "finalized") return; // nothing changes once finalized
  const s = await api(`sessions/${encodeURIComponent(sessionId)}`);
  if (state.openSession !== sessionId) return;
  detail.hidden = false;
  detail.dataset.session = sessionId;
  detail.dataset.status = s.status;
  renderSession(s, sessionView);
  if (scroll) detail.scrollIntoView({ behavior: "smooth", block: "start" });
}

// ---- wiring -----------------------------------------------------------------------------------

function wire() {
  $("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    signIn($("key-input").value.trim());
    $("key-input").value = "";
  });
  $("sign-out").addEventListener("click", () => signOut(""));
  $("live").addEventListener("change", () => ($("live").checked ? refresh() : clearTimeout(state.timer)));
  $("reward-controls").addEventListener("submit", (event) => {
    event.preventDefault();
    loadRewards().catch((error) => showError(`Rewards could not be read: ${error.message}`));
  });
  $("session-filters").addEventListener("submit", (event) => {
    event.preventDefault();
    state.filters = readFilters();
    state.pages = [null];
    loadSessions().catch((error) => { $("page-info").textContent = error.message; });
  });
  $("older-page").addEventListener("click", () => {
    if (!state.nextCursor) return;
    state.pages.push(state.nextCursor);
    loadSessions().catch((error) => { $("page-info").textContent = error.message; });
  });
  $("newer-page").addEventListener("click", () => {
    if (state.pages.length > 1) state.pages.pop();
    loadSessions().catch((error) => { $("page-info").textContent = error.message; });
  });
  $("close-detail").addEventListener("click", () => {
    state.openSession = null;
    $("session-detail").hidden = true;
    delete $("session-detail").dataset.session;
    document.querySelectorAll("#sessions-table tr.selected").forEach((row) => row.classList.remove("selected"));
  });
  document.addEventListener("visibilitychange", () => { if (!document.hidden && !$("main").hidden) refresh(); });
  if (sessionStorage.getItem(KEY_STORAGE)) signIn(sessionStorage.getItem(KEY_STORAGE));
}

wire();
