// The session drill-down of the Flywheel dashboard (dashboard.js): one session's fields, its
// conversation tree with every generated token coloured by its probability and underlined in its
// policy version's colour, and its rewards, hook jobs and trajectories. It draws a session document of
// the API and fetches nothing itself: dashboard.js owns the API, its errors and when to redraw.
import { badge, colourOf, el, fmt, when } from "./charts.js";

const $ = (id) => document.getElementById(id);

function versionColour(version) {
  return version < 0 ? "#9aa1ad" : colourOf(version);
}

// A logprob's colour: red for unlikely tokens through yellow to green for near-certain ones.
function probabilityColour(logprob) {
  if (logprob === null || logprob === undefined) return "hsl(0, 0%, 90%)";
  const p = Math.min(Math.max(Math.exp(logprob), 0), 1);
  return `hsl(${Math.round(p * 120)}, 75%, 82%)`;
}

function tokenSpans(tokens) {
  const spans = [];
  let previous = null;
  tokens.ids.forEach((id, i) => {
    const version = tokens.versions[i];
    const logprob = tokens.logprobs[i];
    if (version !== previous) {
      spans.push(el("span", { className: "version-mark", text: `v${version}` }));
      previous = version;
    }
    const text = tokens.texts[i];
    const span = el("span", {
      className: text === null ? "token unknown" : "token",
      text: text === null ? `⟨${id}⟩` : text,
      title: `token ${id} · logprob ${logprob === null ? "–" : logprob.toFixed(4)}`
        + `${logprob === null ? "" : ` (p ${Math.exp(logprob).toFixed(3)})`} · v${version}`,
      dataset: { id, logprob: logprob === null ? "" : logprob, version },
    });
    span.style.backgroundColor = probabilityColour(logprob);
    span.style.borderBottomColor = versionColour(version);
    spans.push(span);
  });
  return spans;
}

// `view.moreTokens(completionId, offset)` resolves to the next page of a completion's tokens;
// `view.showError(message)` reports one that could not be read.
function completionBlock(c, view) {
  const tokens = el("div", { className: "tokens" }, tokenSpans(c.tokens));
  const block = el("div", { className: c.branched ? "completion branched" : "completion", dataset: { completion: c.id } },
    el("div", { className: "head" },
      el("span", { className: "cid mono", text: c.id }),
      c.branched ? badge("branch", "branch") : null,
      c.orphan_of ? badge(`retry orphan of ${c.orphan_of}`, "failed") : null,
      badge(c.finish_reason, "finish"),
      el("span", { text: `${c.prompt_tokens} prompt + ${c.completion_tokens} generated tokens` }),
      el("span", { text: `versions ${c.versions.map((v) => `v${v}`).join(", ") || "–"}` }),
      el("span", { text: `temperature ${fmt(c.temperature)}` }),
      c.reward === null ? null : el("span", { text: `reward ${fmt(c.reward)}` })),
    c.prompt_text.text ? el("div", { className: "prompt-text", text: c.prompt_text.text,
      title: `${c.prompt_text.tokens} stored prompt tokens${c.prompt_text.truncated ? " (the last ones shown)" : ""}` }) : null,
    tokens);
  block.style.marginLeft = `${Math.min(c.depth, 12) * 18}px`;
  const shown = () => c.tokens.offset + c.tokens.ids.length;
  if (shown() < c.tokens.total) {
    const more = el("button", { type: "button", className: "more", text: `show more (${shown()} of ${c.tokens.total})` });
    more.addEventListener("click", async () => {
      let page;
      try {
        page = await view.moreTokens(c.id, shown());
      } catch (error) {
        view.showError(`More tokens could not be read: ${error.message}`);
        return;
      }
      for (const name of ["ids", "texts", "logprobs", "versions"]) c.tokens[name].push(...page[name]);
      tokens.replaceChildren(...tokenSpans(c.tokens));
      if (shown() >= c.tokens.total) more.remove();
      else more.textContent = `show more (${shown()} of ${c.tokens.total})`;
    });
    block.append(more);
  }
  return block;
}

// Fills the #session-detail panel's parts from `s`, a document of GET /dashboard/api/sessions/{id}.
export function renderSession(s, view) {
  $("detail-id").textContent = s.session_id;
  const fields = [
    ["status", badge(s.status)], ["run", s.run === null ? "–" : s.run], ["group", s.group_id || "–"],
    ["task", s.task === null ? "–" : JSON.stringify(s.task)],
    ["metadata", JSON.stringify(s.metadata)], ["created", when(s.created_at)], ["ended", when(s.ended_at)],
    ["reward", `${fmt(s.reward.total)} (session ${fmt(s.reward.session)}, `
      + `${Object.keys(s.reward.completions).length} completion reward(s))`],
    ["completions", `${s.completions_total}${s.completions.length < s.completions_total ? ` (first ${s.completions.length} shown)` : ""}`],
  ];
  $("detail-head").replaceChildren(...fields.flatMap(([name, value]) => [el("dt", { text: name }), el("dd", {}, value)]));
  $("detail-tree").replaceChildren(...(s.completions.length
    ? s.completions.map((c) => completionBlock(c, view))
    : [el("p", { className: "muted", text: "No completion recorded." })]));
  $("detail-rewards").tBodies[0].replaceChildren(...s.rewards.map((r) => el("tr", {},
    el("td", { text: r.id }), el("td", { className: "mono", text: r.completion_id || "session" }),
    el("td", { text: r.source }), el("td", { className: "num", text: fmt(r.value) }), el("td", { text: when(r.created_at) }))));
  $("detail-hooks").tBodies[0].replaceChildren(...s.hooks.map((j) => el("tr", {},
    el("td", { text: j.source }), el("td", { text: j.level }), el("td", {}, badge(j.state)),
    el("td", { text: `${j.attempts}/${j.max_attempts}` }),
    el("td", { className: "wrap", text: j.error || (j.result ? JSON.stringify(j.result) : "–") }),
    el("td", { text: when(j.finished_at) }))));
  $("detail-trajectories").tBodies[0].replaceChildren(...s.trajectories.map((t) => el("tr", {},
    el("td", { text: t.id }), el("td", { className: "num", text: t.tokens }), el("td", { className: "num", text: t.trained_tokens }),
    el("td", { className: "num", text: fmt(t.reward) }), el("td", { text: `v${t.min_version}` }),
    el("td", { text: t.consumed_step !== null ? `trained by step ${t.consumed_step}` : (t.claimed ? "claimed" : "waiting") }))));
}
