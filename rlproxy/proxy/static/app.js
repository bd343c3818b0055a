// The dashboard: reads the proxy's JSON routes and draws runs per status, the reward curve and the
// latest trajectories. Plain DOM, no framework; every value from the API is set with textContent.
"use strict";

(function () {
  const STATUSES = ["open", "completed", "trained", "skipped", "failed", "expired"];
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
    const counts = (await api("v1/runs/stats")).by_status;
    const note = "";
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

  // --- mean reward per training step ---
  async function loadSteps() {
    const steps = items(await api("v1/training/steps?limit=500"), "steps");
    const points = steps
      .filter((s) => s.mean_reward !== null && s.mean_reward !== undefined)
      .map((s) => ({
        x: Number(s.step),
        y: Number(s.mean_reward),
        label: `step ${s.step}${s.policy ? ` (${s.policy})` : ""}: mean reward ${fmt(Number(s.mean_reward))}`,
      }));
    const drawn = window.lineChart($("chart"), points, { yMin: 0, yMax: 1, xLabel: "training step" });
    $("chart").dataset.points = String(drawn);
    const last = steps.reduce((a, s) => (a === null || Number(s.step) > Number(a.step) ? s : a), null);
    $("steps-note").textContent = last
      ? `${steps.length} steps; latest ${last.step}: mean reward ${fmt(last.mean_reward)}` +
        (last.loss === null || last.loss === undefined ? "" : `, loss ${fmt(last.loss, 4)}`)
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
