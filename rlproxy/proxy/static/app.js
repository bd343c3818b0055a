// The dashboard: reads the proxy's JSON routes and draws runs per status, the reward of every group
// over time, the per-step learning charts, a filterable list of runs and the untagged requests (the
// run's page, a call's sampled tokens and two steps compared on the validation prompts are
// dig.js's). Plain DOM, no framework; every value from the API is set with textContent. The
// filters, the page of runs and the chart's policy live in the URL's fragment
// (`#status=skipped&policy=...&offset=25`): a reload or a shared link shows the same list. The admin
// key comes from the input field or `#key=` (a fragment: never sent to the server, so never in an
// access log), and is kept in this browser's localStorage. Over 400 lines: the overview's sections
// share one state, one `api` and the URL's filters; split further, each file would pass them around.
"use strict";

(function () {
  const STATUSES = ["open", "completed", "ungrouped", "validated", "trained", "skipped", "failed", "expired"];
  const PAGE = 25;
  const params = new URLSearchParams(window.location.search);
  const state = { key: localStorage.getItem("rlproxy.key") || "", policy: null, chosen: false, offset: 0, filters: {} };
  const $ = (id) => document.getElementById(id);

  function hashParams() {
    return new URLSearchParams(window.location.hash.replace(/^#/, ""));
  }
  {
    const h = hashParams();
    if (h.get("key")) {
      state.key = h.get("key");
      localStorage.setItem("rlproxy.key", state.key);
      h.delete("key");
      history.replaceState(null, "", `${window.location.pathname}${window.location.search}${h.toString() ? `#${h}` : ""}`);
    }
  }

  function text(tag, value, cls) {
    const node = document.createElement(tag);
    node.textContent = value === null || value === undefined ? "" : String(value);
    if (cls) node.className = cls;
    return node;
  }

  // The API answers lists either bare or wrapped ({data: [...]}, {runs: [...]}, ...): accept both.
  function items(body, ...keys) {
    if (Array.isArray(body)) return body;
    for (const k of [...keys, "data", "items", "results"]) if (body && Array.isArray(body[k])) return body[k];
    return [];
  }

  async function api(path) {
    const headers = { Accept: "application/json" };
    if (state.key) headers.Authorization = `Bearer ${state.key}`;
    const response = await fetch(path, { headers });
    if (response.status === 401 || response.status === 403) {
      $("auth").hidden = false;
      throw new Error("this proxy needs its admin key (RLPROXY_ADMIN_KEY): enter it above");
    }
    if (!response.ok) {
      const err = new Error(`${path}: HTTP ${response.status}`);
      err.status = response.status;
      throw err;
    }
    return response.json();
  }

  function fmt(value, digits) {
    if (value === null || value === undefined || value === "") return "";
    return typeof value === "number" ? value.toFixed(digits === undefined ? 3 : digits) : String(value);
  }

  // Dates with their day: a run from yesterday must not look like one from an hour ago.
  function when(value) {
    if (!value) return "";
    const d = new Date(typeof value === "number" ? value * 1000 : value);
    return Number.isNaN(d.getTime()) ? String(value) : d.toLocaleString(undefined, { dateStyle: "medium", timeStyle: "medium" });
  }
  const num = (v) => (v === null || v === undefined || v === "" ? NaN : Number(v));

  // --- runs per status: GET /v1/runs/stats; a click lists that status ---
  async function loadCounts() {
    const stats = await api("v1/runs/stats");
    const counts = stats.by_status;
    const box = $("counts");
    box.replaceChildren();
    for (const s of [...STATUSES, ...Object.keys(counts).filter((k) => !STATUSES.includes(k))]) {
      if (typeof counts[s] !== "number") continue;
      const card = document.createElement("button");
      card.type = "button";
      card.className = `count status-${s}${state.filters.status === s ? " active" : ""}`;
      card.dataset.status = s;
      card.append(text("b", counts[s]), text("span", s));
      card.addEventListener("click", () => {
        const status = state.filters.status === s ? "" : s;
        $("f-status").value = status;
        applyFilters();
      });
      box.append(card);
    }
    $("counts-note").textContent = stats.notice || ""; // most runs ungrouped: what to set (docs: Live traffic)
    const select = $("f-status");
    const known = new Set([...select.options].map((o) => o.value));
    for (const s of Object.keys(counts)) if (!known.has(s)) select.append(text("option", s));
  }

  // --- the policy picker: opens on the server's default_policy (never an empty fork), keeps a choice ---
  function pickPolicy(policies, preferred) {
    const select = $("policy");
    if (!state.chosen || !policies.includes(state.policy)) state.policy = preferred || policies[0] || null;
    select.replaceChildren(...policies.map((p) => text("option", p)));
    select.value = state.policy || "";
    select.hidden = policies.length < 2;
    const filter = $("f-policy");
    const known = new Set([...filter.options].map((o) => o.value));
    for (const p of policies) if (!known.has(p)) filter.append(text("option", p));
  }

  // --- per training step: GET /v1/training/metrics (the metric columns of training_steps) ---
  // Each chart plots columns of one policy's steps; `svg.dataset.points` says how many points it drew.
  // The charts come with the data (`charts`: proxy/dashboard.py step_charts, made from storage's one
  // list of step columns): {id, title, unit, cols, names?, yMin?, yMax?, sft?}. SFT steps (kind = sft)
  // have their own loss chart (`sft`); on the reward chart they are dashed marks.
  let CHARTS = [];

  function chartBoxes(charts) {
    const box = $("charts");
    if (box.childElementCount) return;
    CHARTS = charts;
    for (const c of CHARTS) {
      const fig = document.createElement("figure");
      const cap = text("figcaption", c.title);
      if (c.unit) cap.append(" ", text("span", `(${c.unit})`));
      const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
      svg.id = `chart-${c.id}`;
      svg.setAttribute("class", "chart mini");
      svg.setAttribute("role", "img");
      svg.setAttribute("aria-label", `${c.title} per training step`);
      fig.append(cap, svg);
      box.append(fig);
    }
  }

  async function loadSteps() {
    const body = await api("v1/training/metrics?limit=1000");
    pickPolicy(body.policies || [], body.default_policy);
    const steps = items(body).filter((s) => s.policy === state.policy);
    const trained = steps.filter((s) => s.kind !== "sft");
    const points = trained
      .filter((s) => Number.isFinite(num(s.mean_reward)))
      .map((s) => {
        const y = num(s.mean_reward);
        const sd = num(s.reward_std);
        return {
          x: Number(s.step), y, lo: y - sd, hi: y + sd,
          label: `step ${s.step} (${s.policy}, ${when(s.finished_at)}): mean reward ${fmt(y)}` + (Number.isFinite(sd) ? ` ± ${fmt(sd)}` : ""),
        };
      });
    // validation runs (docs: Validation runs): step N's val_reward is the mean reward of the val runs
    // served by adapter N-1, the one that also sampled most of step N's training runs: same x
    const val = steps
      .filter((s) => Number.isFinite(num(s.val_reward)))
      .map((s) => ({
        x: Number(s.step),
        y: num(s.val_reward),
        label: `step ${s.step}: validation reward ${fmt(num(s.val_reward))} over ${s.val_runs} runs (adapter ${s.step - 1})`,
      }));
    const marks = steps.filter((s) => s.kind === "sft").map((s) => ({ x: Number(s.step), short: "SFT", label: `step ${s.step}: SFT, loss ${window.tickLabel(num(s.loss))}` }));
    const series = [{ name: "train", points, cls: "s0" }];
    if (val.length) series.push({ name: "validation", points: val, cls: "s1" });
    const drawn = window.multiChart($("chart"), series, { yMin: 0, yMax: 1, xLabel: "training step", band: true, marks });
    $("chart").dataset.points = String(drawn);
    chartBoxes(body.charts || []);
    for (const c of CHARTS) {
      const rows = c.sft ? steps.filter((s) => s.kind === "sft") : trained;
      const series = c.cols.map((col, i) => ({
        name: c.names ? c.names[i] : col,
        points: rows
          .map((s) => ({ x: Number(s.step), y: num(s[col]) }))
          .map((p) => ({ ...p, label: `step ${p.x}: ${c.names ? `${c.names[i]} ` : ""}${c.title} ${window.tickLabel(p.y)}` })),
      }));
      const svg = $(`chart-${c.id}`);
      svg.dataset.points = String(window.multiChart(svg, series, { yMin: c.yMin, yMax: c.yMax, xLabel: "step" }));
    }
    const last = trained.length ? trained[trained.length - 1] : null;
    const g = (v) => (Number.isFinite(num(v)) ? window.tickLabel(+num(v).toPrecision(3)) : "–");
    const sft = steps.length - trained.length;
    $("steps-note").textContent = last
      ? `${steps.length} steps of ${state.policy}${sft ? ` (${sft} SFT)` : ""}; latest trained ${last.step} (${when(last.finished_at)}): mean reward ${fmt(last.mean_reward)}` +
        (last.loss === null || last.loss === undefined ? "" : `, loss ${g(last.loss)}, KL ${g(last.kl)}`) +
        (Number.isFinite(num(last.val_reward)) ? `, validation ${fmt(last.val_reward)}` : "")
      : "no training step yet";
  }

  // --- every rewarded group over time: GET /v1/training/groups, one point per group and outcome ---
  // A group_id the trainer took in several batches is several points (8 runs trained at step 1, 8
  // skipped), each the mean of its own runs; the caption's run counts are the status cards' counts.
  // Points only: two groups are unrelated (another prompt), so no line joins them.
  const OUTCOMES = [["trained", "s0"], ["skipped", "s3"], ["failed", "s5"], ["waiting", "s4"], ["ungrouped", "s6"]];

  async function loadGroups() {
    const body = await api(`v1/training/groups?limit=2000${state.policy ? `&policy=${encodeURIComponent(state.policy)}` : ""}`);
    const groups = items(body);
    const by = Object.fromEntries(OUTCOMES.map(([o]) => [o, []]));
    const runs = Object.fromEntries(OUTCOMES.map(([o]) => [o, 0]));
    for (const g of groups) {
      const o = by[g.outcome] ? g.outcome : "waiting";
      runs[o] += g.runs;
      by[o].push({
        x: new Date(g.at).getTime(), y: g.mean_reward, cls: o, id: g.group_id, r: Math.min(9, 2.5 + Math.sqrt(g.runs)), // area ~ runs
        label: `${when(g.at)} group ${String(g.group_id).slice(0, 16)}: mean reward ${fmt(g.mean_reward)} over ${g.runs} run${g.runs === 1 ? "" : "s"} (${fmt(g.min_reward, 2)}–${fmt(g.max_reward, 2)}), ${g.status}` +
          (g.trained_step !== null && g.trained_step !== undefined ? ` at step ${g.trained_step}` : "") + (g.reason ? ` (${g.reason})` : ""),
      });
    }
    const series = OUTCOMES.map(([o, cls]) => ({ name: o, points: by[o], cls })).filter((s) => s.points.length);
    const svg = $("groups-chart");
    svg.dataset.points = String(window.multiChart(svg, series, { yMin: 0, yMax: 1, xLabel: "time of the group's last reward", xTime: true, line: false }));
    const total = body.runs || runs; // every run, however many points were drawn (an older proxy: the points')
    const parts = OUTCOMES.filter(([o]) => total[o] || o === "skipped").map(([o]) => `${total[o]} ${o === "waiting" ? "completed (waiting)" : o}`);
    svg.dataset.runs = JSON.stringify(total);
    $("groups-note").textContent = groups.length
      ? `${groups.length} points${state.policy ? ` of ${state.policy}` : ""}; rewarded training runs: ${parts.join(", ")}`
      : "no rewarded group yet";
  }

  // --- runs: GET /v1/admin/runs with the filters and paging ---
  function readFilters() {
    const f = {};
    const v = (id) => $(id).value.trim();
    if (v("f-status")) f.status = v("f-status");
    if (v("f-policy")) f.policy = v("f-policy");
    if (v("f-group")) f.group_id = v("f-group");
    if (v("f-split")) f.split = v("f-split");
    if (v("f-min")) f.min_reward = v("f-min");
    if (v("f-max")) f.max_reward = v("f-max");
    for (const [id, name] of [["f-since", "since"], ["f-until", "until"]]) {
      if (v(id)) f[name] = new Date(v(id)).toISOString(); // the browser's local time, sent as UTC
    }
    if (v("f-q")) f.q = v("f-q");
    return f;
  }

  // The filters' inputs <-> the URL's fragment (their raw values: a time stays the browser's local one).
  const FILTER_INPUTS = [["f-status", "status"], ["f-policy", "policy"], ["f-group", "group"], ["f-split", "split"], ["f-min", "min"], ["f-max", "max"], ["f-since", "since"], ["f-until", "until"], ["f-q", "q"]];

  function saveHash() {
    const h = new URLSearchParams();
    for (const [id, name] of FILTER_INPUTS) if ($(id).value.trim()) h.set(name, $(id).value.trim());
    if (state.offset) h.set("offset", String(state.offset));
    if (state.chosen && state.policy) h.set("chart", state.policy);
    const frag = h.toString();
    history.replaceState(null, "", `${window.location.pathname}${window.location.search}${frag ? `#${frag}` : window.location.hash ? "#" : ""}`);
    for (const a of document.querySelectorAll("a.back")) a.href = `#${frag}`;
  }

  function restoreHash() {
    const h = hashParams();
    for (const [id, name] of FILTER_INPUTS) {
      const el = $(id);
      const v = h.get(name) || "";
      if (el.tagName === "SELECT" && v && ![...el.options].some((o) => o.value === v)) el.append(text("option", v));
      el.value = v;
    }
    state.filters = readFilters();
    state.offset = Math.max(0, Number(h.get("offset")) || 0);
    if (h.get("chart")) {
      state.policy = h.get("chart");
      state.chosen = true;
    }
    for (const a of document.querySelectorAll("a.back")) a.href = window.location.hash || "#";
  }

  function applyFilters() {
    state.filters = readFilters();
    state.offset = 0;
    saveHash();
    loadRuns().then(loadCounts).catch(showError);
  }

  async function loadRuns() {
    const q = new URLSearchParams({ ...state.filters, limit: String(PAGE), offset: String(state.offset) });
    const body = await api(`v1/admin/runs?${q}`);
    const runs = items(body);
    const tbody = $("runs").querySelector("tbody");
    tbody.replaceChildren();
    for (const r of runs) {
      const tr = document.createElement("tr");
      tr.className = "run";
      tr.dataset.runId = r.id;
      tr.append(
        text("td", r.id, "mono"),
        text("td", r.group_id ? String(r.group_id).slice(0, 16) : "", "mono"),
        text("td", r.policy),
        text("td", r.split),
        text("td", r.status, `status-${r.status}`),
        text("td", fmt(r.reward), "num"),
        text("td", r.n_completions ?? "", "num"),
        text("td", r.trained_step ?? "", "num"),
        text("td", when(r.created_at)),
      );
      tr.addEventListener("click", () => (window.location.hash = `run=${encodeURIComponent(r.id)}`));
      tbody.append(tr);
    }
    const total = body.total || 0;
    const filtered = Object.keys(state.filters).length > 0;
    $("runs-total").textContent = `${total} run${total === 1 ? "" : "s"}${filtered ? " match the filters" : ""}`;
    $("page-info").textContent = total ? `${state.offset + 1}–${state.offset + runs.length} of ${total}` : "";
    $("prev").disabled = state.offset === 0;
    $("next").disabled = state.offset + runs.length >= total;
    $("runs-note").textContent = runs.length
      ? ""
      : filtered ? "no run matches these filters" : "no runs yet: send a request with an X-Run-Id header";
  }

  // --- untagged requests: GET /v1/admin/untagged ---
  async function loadUntagged() {
    let body;
    try {
      body = await api("v1/admin/untagged?limit=10");
    } catch (e) {
      if (e.status === 404) return; // an older proxy
      throw e;
    }
    $("untagged-total").textContent = `${body.total} request${body.total === 1 ? "" : "s"} without a run id`;
    const tbody = $("untagged").querySelector("tbody");
    tbody.replaceChildren();
    for (const u of items(body)) {
      const tr = document.createElement("tr");
      tr.append(
        text("td", u.reply_id, "mono"),
        text("td", u.policy),
        text("td", u.policy_step ?? "", "num"),
        text("td", u.status_code ?? u.status ?? ""),
        text("td", u.finish_reason),
        text("td", `${u.prompt_tokens ?? "?"} + ${u.completion_tokens ?? "?"}`, "num"),
        text("td", when(u.created_at)),
      );
      tbody.append(tr);
    }
  }

  // --- a run's page, a call's tokens: dig.js ---
  async function showRun(id) {
    await window.rlDig.run(id, { api, text, fmt, when, $, hash: hashParams() });
    document.body.dataset.loaded = "true";
  }

  // --- two steps or policies on the same validation prompts (dig.js) ---
  async function showCompare() {
    const h = hashParams();
    await window.rlDig.compare($("compare-box"), api, text, h.get("a"), h.get("b"), (a, b) => {
      window.location.hash = `compare&${new URLSearchParams({ a, b })}`;
    });
    document.body.dataset.loaded = "true";
  }

  function showError(e) {
    $("error").textContent = String((e && e.message) || e);
  }

  async function refresh() {
    const h = hashParams();
    if (h.has("run") || h.has("compare")) return; // a run's page does not refresh under the reader
    $("error").textContent = "";
    try {
      await loadCounts();
      await loadSteps();
      await Promise.all([loadGroups(), loadRuns(), loadUntagged()]);
      $("updated").textContent = `updated ${when(new Date().toISOString())}`;
      document.body.dataset.loaded = "true";
    } catch (e) {
      showError(e);
    }
  }

  function route() {
    document.body.dataset.loaded = "";
    $("error").textContent = "";
    const h = hashParams();
    const page = h.has("run") ? "run-page" : h.has("compare") ? "compare-page" : "overview";
    for (const id of ["overview", "run-page", "compare-page"]) $(id).hidden = id !== page;
    if (page === "run-page") showRun(h.get("run")).catch(showError);
    else if (page === "compare-page") showCompare().catch(showError);
    else {
      restoreHash();
      refresh();
    }
  }

  $("key").value = state.key;
  $("auth").hidden = !state.key;
  $("policy").addEventListener("change", () => {
    state.policy = $("policy").value;
    state.chosen = true;
    saveHash();
    Promise.all([loadSteps(), loadGroups()]).catch(showError);
  });
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    state.key = $("key").value.trim();
    localStorage.setItem("rlproxy.key", state.key);
    route();
  });
  $("filters").addEventListener("submit", (ev) => {
    ev.preventDefault();
    applyFilters();
  });
  $("f-clear").addEventListener("click", () => {
    for (const el of $("filters").querySelectorAll("input, select")) el.value = "";
    applyFilters();
  });
  $("prev").addEventListener("click", () => {
    state.offset = Math.max(0, state.offset - PAGE);
    saveHash();
    loadRuns().catch(showError);
  });
  $("next").addEventListener("click", () => {
    state.offset += PAGE;
    saveHash();
    loadRuns().catch(showError);
  });
  window.addEventListener("hashchange", route);
  route();
  const every = Number(params.get("refresh") || 5);
  if (every > 0) setInterval(refresh, every * 1000);
})();
