// The dashboard: reads the proxy's JSON routes and draws runs per status, the reward curve and the
// latest trajectories. Plain DOM, no framework; every value from the API is set with textContent.
"use strict";

(function () {
  const STATUSES = ["open", "completed", "ungrouped", "validated", "trained", "skipped", "failed", "expired"];
  const params = new URLSearchParams(window.location.search);
  const state = { key: params.get("key") || localStorage.getItem("rlproxy.key") || "", selected: null };
  const $ = (id) => document.getElementById(id);

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

  function when(value) {
    if (!value) return "";
    const d = new Date(typeof value === "number" ? value * 1000 : value);
    return Number.isNaN(d.getTime()) ? String(value) : d.toLocaleTimeString();
  }

  // --- runs per status: GET /v1/runs/stats ---
  async function loadCounts() {
    const stats = await api("v1/runs/stats");
    const counts = stats.by_status;
    const note = stats.notice || ""; // most rewarded runs ungrouped: what to set (README: Live traffic)
    const box = $("counts");
    box.replaceChildren();
    for (const s of [...STATUSES, ...Object.keys(counts).filter((k) => !STATUSES.includes(k))]) {
      if (typeof counts[s] !== "number") continue;
      const card = document.createElement("div");
      card.className = `count status-${s}`;
      card.dataset.status = s;
      card.append(text("b", counts[s]), text("span", s));
      box.append(card);
    }
    $("counts-note").textContent = note;
  }

  // --- per training step: GET /v1/training/metrics (the metric columns of training_steps) ---
  // Each chart plots columns of one policy's steps; `svg.dataset.points` says how many points it drew.
  const CHARTS = [
    { id: "zero_variance_frac", title: "zero-variance groups", unit: "fraction, skipped ones too", cols: ["zero_variance_frac"], yMin: 0, yMax: 1 },
    { id: "kl", title: "KL", unit: "per token", cols: ["kl"] },
    { id: "clip", title: "clipped tokens", unit: "fraction", cols: ["clip_frac_low", "clip_frac_high"], names: ["low", "high"], yMin: 0 },
    { id: "entropy", title: "entropy", unit: "nats per token", cols: ["entropy"], yMin: 0 },
    { id: "completion_len_mean", title: "completion length", unit: "tokens", cols: ["completion_len_mean"], yMin: 0 },
    { id: "policy_lag_mean", title: "policy lag", unit: "adapter steps", cols: ["policy_lag_mean"], yMin: 0 },
    { id: "tokens_per_s", title: "training throughput", unit: "tokens/s", cols: ["tokens_per_s"], yMin: 0 },
    { id: "grad_norm", title: "gradient norm", unit: "before clipping", cols: ["grad_norm"], yMin: 0 },
    { id: "loss", title: "loss", unit: "", cols: ["loss"] },
  ];
  const num = (v) => (v === null || v === undefined || v === "" ? NaN : Number(v));

  function chartBoxes() {
    const box = $("charts");
    if (box.childElementCount) return;
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

  function pickPolicy(policies) {
    const select = $("policy");
    if (!policies.includes(state.policy)) state.policy = policies[0] || null; // newest step's policy
    select.replaceChildren(...policies.map((p) => text("option", p)));
    select.value = state.policy || "";
    select.hidden = policies.length < 2;
  }

  async function loadSteps() {
    const body = await api("v1/training/metrics?limit=1000");
    pickPolicy(body.policies || []);
    const steps = items(body).filter((s) => s.policy === state.policy);
    const points = steps
      .filter((s) => Number.isFinite(num(s.mean_reward)))
      .map((s) => {
        const y = num(s.mean_reward);
        const sd = num(s.reward_std);
        return {
          x: Number(s.step),
          y,
          lo: y - sd,
          hi: y + sd,
          label: `step ${s.step}${s.policy ? ` (${s.policy})` : ""}: mean reward ${fmt(y)}` +
            (Number.isFinite(sd) ? ` ± ${fmt(sd)}` : ""),
        };
      });
    // validation runs (README: Validation runs): step N's val_reward is the mean reward of the val runs
    // served by adapter N-1, the one that also sampled most of step N's training runs: same x
    const val = steps
      .filter((s) => Number.isFinite(num(s.val_reward)))
      .map((s) => ({
        x: Number(s.step),
        y: num(s.val_reward),
        label: `step ${s.step}: validation reward ${fmt(num(s.val_reward))} over ${s.val_runs} runs (adapter ${s.step - 1})`,
      }));
    const series = [{ name: "train", points, cls: "s0" }];
    if (val.length) series.push({ name: "validation", points: val, cls: "s1" });
    const opts = { yMin: 0, yMax: 1, xLabel: "training step", band: true };
    const drawn = window.multiChart($("chart"), series, opts);
    $("chart").dataset.points = String(drawn);
    chartBoxes();
    for (const c of CHARTS) {
      const series = c.cols.map((col, i) => ({
        name: c.names ? c.names[i] : col,
        points: steps
          .map((s) => ({ x: Number(s.step), y: num(s[col]) }))
          .map((p) => ({ ...p, label: `step ${p.x}: ${c.names ? `${c.names[i]} ` : ""}${c.title} ${window.tickLabel(p.y)}` })),
      }));
      const svg = $(`chart-${c.id}`);
      svg.dataset.points = String(window.multiChart(svg, series, { yMin: c.yMin, yMax: c.yMax, xLabel: "step" }));
    }
    const last = steps.length ? steps[steps.length - 1] : null;
    const g = (v) => (Number.isFinite(num(v)) ? window.tickLabel(+num(v).toPrecision(3)) : "–");
    $("steps-note").textContent = last
      ? `${steps.length} steps of ${state.policy}; latest ${last.step}: mean reward ${fmt(last.mean_reward)}` +
        (last.loss === null || last.loss === undefined ? "" : `, loss ${g(last.loss)}, KL ${g(last.kl)}`) +
        (Number.isFinite(num(last.val_reward)) ? `, validation ${fmt(last.val_reward)}` : "")
      : "no training step yet";
  }

  // --- the latest runs, and the messages of the selected one ---
  function renderRuns(runs) {
    const body = $("runs").querySelector("tbody");
    body.replaceChildren();
    for (const r of runs) {
      const tr = document.createElement("tr");
      tr.className = "run";
      tr.dataset.runId = r.id;
      if (r.id === state.selected) tr.classList.add("selected");
      tr.append(
        text("td", r.id, "mono"),
        text("td", r.group_id ? String(r.group_id).slice(0, 16) : "", "mono"),
        text("td", r.status, `status-${r.status}`),
        text("td", fmt(r.reward), "num"),
        text("td", r.n_completions ?? r.num_completions ?? r.completions ?? "", "num"),
        text("td", r.trained_step ?? "", "num"),
        text("td", when(r.created_at)),
      );
      tr.addEventListener("click", () => selectRun(r.id));
      body.append(tr);
    }
    $("runs-note").textContent = runs.length ? "" : "no runs yet: send a request with an X-Run-Id header";
  }

  function messagesOf(run) {
    // Preferred: the run's trajectory as the `trajectories` view has it (the last call's messages
    // and its reply); rows of the `messages` view carry `seq` (which call) and are grouped by it.
    if (Array.isArray(run.messages) && run.messages.length) {
      return run.messages.map((m) => ({ seq: m.seq ?? null, role: m.role, content: m.content, tools: m.tool_calls }));
    }
    const out = [];
    for (const c of run.completions || []) {
      for (const m of (c.request && c.request.messages) || []) out.push({ seq: c.seq, role: m.role, content: m.content });
      if (c.request && typeof c.request.prompt === "string") out.push({ seq: c.seq, role: "prompt", content: c.request.prompt });
      const choice = c.response && c.response.choices && c.response.choices[0];
      if (choice) {
        const msg = choice.message || { role: "assistant", content: choice.text };
        out.push({ seq: c.seq, role: msg.role || "assistant", content: msg.content, tools: msg.tool_calls });
      }
    }
    return out;
  }

  async function selectRun(id) {
    state.selected = id;
    for (const tr of document.querySelectorAll("#runs tr.run")) tr.classList.toggle("selected", tr.dataset.runId === id);
    const run = await api(`v1/runs/${encodeURIComponent(id)}`);
    const box = $("trajectory");
    box.replaceChildren();
    box.append(
      text("h3", `run ${run.id || id}`),
      text("p", `status ${run.status || "?"} · reward ${fmt(run.reward)} · group ${run.group_id || ""}`, "meta"),
    );
    let seq = null;
    for (const m of messagesOf(run)) {
      if (m.seq !== null && m.seq !== undefined && m.seq !== seq) {
        seq = m.seq;
        box.append(text("div", `model call ${seq}`, "call"));
      }
      const row = document.createElement("div");
      row.className = `msg role-${m.role}`;
      const content = typeof m.content === "string" ? m.content : JSON.stringify(m.content);
      row.append(text("span", m.role, "role"), text("pre", content || (m.tools ? JSON.stringify(m.tools) : "")));
      box.append(row);
    }
  }

  async function refresh() {
    $("error").textContent = "";
    try {
      const runs = items(await api("v1/runs?limit=25"), "runs");
      renderRuns(runs);
      await Promise.all([loadCounts(), loadSteps()]);
      const wanted = runs.find((r) => r.id === state.selected) ? state.selected : runs.length ? runs[0].id : null;
      if (wanted) await selectRun(wanted);
      $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
      document.body.dataset.loaded = "true";
    } catch (e) {
      $("error").textContent = String(e.message || e);
    }
  }

  $("key").value = state.key;
  $("auth").hidden = !state.key;
  $("policy").addEventListener("change", () => {
    state.policy = $("policy").value;
    loadSteps().catch((e) => ($("error").textContent = String(e.message || e)));
  });
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    state.key = $("key").value.trim();
    localStorage.setItem("rlproxy.key", state.key);
    refresh();
  });
  refresh();
  const every = Number(params.get("refresh") || 5);
  if (every > 0) setInterval(refresh, every * 1000);
})();
