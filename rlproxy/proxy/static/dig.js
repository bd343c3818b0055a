// Digging views of the dashboard, called by app.js with its `api` and `text` helpers:
//   rlDig.run(id, helpers)  a run's page (GET /v1/runs/{id}): facts, one row per call, the trajectory,
//       and with `#...&call=ID` that call's tokens
//   rlDig.tokens(box, api, text, completionId)  one call's sampled tokens coloured by logprob, and the
//       reward of its run beside its group's mean (GET /v1/admin/completions/{id}/tokens)
//   rlDig.compare(box, api, text, a, b, onPick)  two steps or policies on the same validation prompts:
//       mean reward per prompt, arm A against arm B (GET /v1/training/compare?a=policy@step&b=...)
// Every value is set with textContent; colours are classes (the CSP allows no inline style).
"use strict";

(function (global) {
  const fmt = (v, d) => (v === null || v === undefined || !Number.isFinite(Number(v)) ? "–" : Number(v).toFixed(d === undefined ? 3 : d));
  const signed = (v) => (Number.isFinite(v) ? `${v >= 0 ? "+" : ""}${v.toFixed(3)}` : "–");

  // logprob buckets: likely (p ≥ 0.9), plausible (≥ 0.37), unlikely (≥ 0.05), surprising (< 0.05)
  const BUCKETS = [[-0.105, "lp0", "p ≥ 0.9"], [-1, "lp1", "p ≥ 0.37"], [-3, "lp2", "p ≥ 0.05"], [-Infinity, "lp3", "p < 0.05"]];
  const bucket = (lp) => (Number.isFinite(lp) ? BUCKETS.find(([lo]) => lp >= lo)[1] : "lpx");

  function cohortLine(body) {
    const run = body.run;
    if (!run) return "an untagged call: no run, no reward";
    if (run.reward === null || run.reward === undefined) return `run ${run.id}: not rewarded yet (${run.status})`;
    const c = body.cohort || {};
    const where = run.trained_step !== null && run.trained_step !== undefined ? `trained at step ${run.trained_step}` : run.status + (run.status_reason ? ` (${run.status_reason})` : "");
    let out = `run reward ${fmt(run.reward)}, ${where}; its group ${run.trained_step !== null && run.trained_step !== undefined ? "in that step" : `(${run.status} runs)`}: ${c.runs} run${c.runs === 1 ? "" : "s"}, mean ${fmt(c.mean_reward)}` + (c.std_reward === null || c.std_reward === undefined ? "" : `, std ${fmt(c.std_reward)}`);
    const diff = Number(run.reward) - Number(c.mean_reward);
    out += `. Advantages are not stored: reward − group mean = ${signed(diff)}`;
    if (c.std_reward > 0) out += ` (÷ std: ${signed(diff / c.std_reward)}, GRPO's advantage with scale_rewards=group)`;
    else if (c.runs > 1) out += " (equal rewards: no gradient)";
    return out;
  }

  async function tokens(box, api, text, id) {
    box.replaceChildren(text("p", "loading tokens…", "note"));
    const body = await api(`v1/admin/completions/${encodeURIComponent(id)}/tokens`);
    box.replaceChildren();
    const n = body.token_ids.reduce((a, ids) => a + ids.length, 0);
    box.append(
      text("h3", `Call ${body.seq} (completion ${body.id}): ${body.policy || "?"}@${body.policy_step ?? "?"}, ${body.prompt_tokens} prompt tokens, ${n} sampled, ${body.finish_reason || ""}`),
      text("p", cohortLine(body), "note cohort"),
    );
    const legend = document.createElement("p");
    legend.className = "note lp-legend";
    legend.append("logprob of each sampled token: ");
    for (const [, cls, label] of BUCKETS) legend.append(text("span", label, `tok ${cls}`), " ");
    legend.append(body.pieces ? "(text pieces: the served model's tokenizer)" : "(token ids: no tokenizer here; the answer's text is below)");
    box.append(legend);
    if (!n) box.append(text("p", "no sampled token ids stored for this call (a hosted upstream, or an error)", "note"));
    body.token_ids.forEach((ids, choice) => {
      const lps = body.logprobs[choice] || [];
      const finite = lps.map(Number).filter(Number.isFinite);
      const mean = finite.length ? finite.reduce((a, b) => a + b, 0) / finite.length : NaN;
      const low = finite.filter((v) => v < -3).length;
      if (body.token_ids.length > 1) box.append(text("h4", `choice ${choice}`));
      box.append(text("p", `${ids.length} tokens, mean logprob ${fmt(mean)}, min ${fmt(finite.length ? Math.min(...finite) : NaN)}, ${low} with p < 0.05`, "note"));
      const pre = document.createElement("pre");
      pre.className = "tokens";
      pre.dataset.choice = String(choice);
      ids.forEach((tid, i) => {
        const lp = Number(lps[i]);
        const piece = body.pieces ? body.pieces[choice][i] : `${tid} `;
        const span = text("span", piece, `tok ${bucket(lp)}`);
        span.title = `#${i} id ${tid} · logprob ${fmt(lp, 4)} · p ${fmt(Math.exp(lp))}`;
        span.dataset.id = String(tid);
        span.dataset.logprob = String(lps[i]);
        pre.append(span);
      });
      box.append(pre);
      const answer = body.text && body.text[choice];
      if (answer !== null && answer !== undefined && answer !== "") {
        box.append(text("h4", "the answer's text"), text("pre", typeof answer === "string" ? answer : JSON.stringify(answer), "answer"));
      }
    });
    return body;
  }

  // --- a run's page: GET /v1/runs/{id}, every call as `rlproxy runs show` has it ---
  function messagesOf(run) {
    if (Array.isArray(run.messages) && run.messages.length) {
      return run.messages.map((m) => ({ role: m.role, content: m.content, tools: m.tool_calls }));
    }
    const out = [];
    for (const c of run.completions || []) {
      for (const m of (c.request && c.request.messages) || []) out.push({ seq: c.seq, role: m.role, content: m.content, tools: m.tool_calls });
      const choice = c.response && c.response.choices && c.response.choices[0];
      if (choice) {
        const msg = choice.message || { role: "assistant", content: choice.text };
        out.push({ seq: c.seq, role: msg.role || "assistant", content: msg.content, tools: msg.tool_calls });
      }
    }
    return out;
  }

  function finishOf(c) {
    const choice = c.response && c.response.choices && c.response.choices[0];
    return c.finish_reason || (choice && choice.finish_reason) || "";
  }

  function toolCalls(c) {
    const choice = c.response && c.response.choices && c.response.choices[0];
    const calls = (choice && choice.message && choice.message.tool_calls) || [];
    return calls.map((t) => `${(t.function && t.function.name) || "?"}(${(t.function && t.function.arguments) || ""})`).join("; ");
  }

  async function runPage(id, h) {
    const { api, text, fmt, when, $ } = h;
    const run = await api(`v1/runs/${encodeURIComponent(id)}`);
    $("run-title").textContent = `run ${run.id}`;
    const facts = $("run-facts");
    facts.replaceChildren();
    const rows = [
      ["status", run.status + (run.status_reason ? ` (${run.status_reason})` : "")],
      ["reward", fmt(run.reward) + (run.reward_source ? ` (${run.reward_source})` : "")],
      ["group", run.group_id], ["policy", run.policy], ["split", run.split],
      ["trained at step", run.trained_step], ["created", when(run.created_at)], ["rewarded", when(run.completed_at)],
      ["metrics", run.metrics ? JSON.stringify(run.metrics) : ""], ["metadata", run.metadata ? JSON.stringify(run.metadata) : ""],
      ["judge", run.judge_explanation || ""],
    ];
    for (const [k, v] of rows) {
      if (v === null || v === undefined || v === "") continue;
      facts.append(text("dt", k), text("dd", v));
    }
    const tbody = $("calls").querySelector("tbody");
    tbody.replaceChildren();
    for (const c of run.completions || []) {
      const tr = document.createElement("tr");
      tr.className = "call-row";
      tr.dataset.completionId = String(c.id);
      if (String(c.id) === h.hash.get("call")) tr.classList.add("selected");
      tr.title = "click: this call's sampled tokens and logprobs";
      tr.addEventListener("click", () => (window.location.hash = `run=${encodeURIComponent(run.id)}&call=${c.id}`));
      tr.append(
        text("td", c.seq, "num"), text("td", c.policy_step ?? "", "num"), text("td", c.adapter, "mono"),
        text("td", c.endpoint), text("td", c.status_code ?? c.status ?? ""), text("td", finishOf(c)),
        text("td", c.prompt_tokens ?? "", "num"), text("td", c.completion_tokens ?? "", "num"),
        text("td", fmt(c.latency_ms, 0), "num"), text("td", fmt(c.ttft_ms, 0), "num"),
        text("td", toolCalls(c), "mono tool"), text("td", when(c.created_at)),
      );
      tbody.append(tr);
      if (c.error) {
        const err = document.createElement("tr");
        const td = text("td", `error: ${c.error}`, "mono status-failed");
        td.colSpan = 12;
        err.append(td);
        tbody.append(err);
      }
    }
    const box = $("trajectory");
    box.replaceChildren();
    for (const m of messagesOf(run)) {
      const row = document.createElement("div");
      row.className = `msg role-${m.role}`;
      const content = typeof m.content === "string" ? m.content : m.content === null || m.content === undefined ? "" : JSON.stringify(m.content);
      const tools = Array.isArray(m.tools) ? (m.tools.length ? JSON.stringify(m.tools) : "") : m.tools ? JSON.stringify(m.tools) : "";
      row.append(text("span", m.role, "role"), text("pre", [content, tools].filter(Boolean).join("\n")));
      box.append(row);
    }
    const call = h.hash.get("call");
    const box2 = $("tokens");
    box2.hidden = !call;
    if (call) {
      await tokens(box2, api, text, call);
      box2.scrollIntoView();
    }
  }

  const armName = (a) => (a ? `${a.policy}@${a.step}` : "");

  async function compare(box, api, text, a, b, onPick) {
    const q = new URLSearchParams();
    if (a) q.set("a", a);
    if (b) q.set("b", b);
    const body = await api(`v1/training/compare?${q}`);
    box.replaceChildren();
    if (!body.arms.length) {
      box.append(text("p", "no validation runs yet: send runs with X-Split: val (docs: Validation runs) to compare steps on the same prompts", "note"));
      return body;
    }
    const form = document.createElement("form");
    form.className = "compare-pick";
    const pickers = ["a", "b"].map((side) => {
      const select = document.createElement("select");
      select.id = `cmp-${side}`;
      for (const arm of body.arms) {
        const o = text("option", `${armName(arm)} (${arm.runs} val runs)`);
        o.value = armName(arm);
        select.append(o);
      }
      select.value = armName(body[side]);
      const label = text("label", `${side.toUpperCase()} `);
      label.append(select);
      form.append(label);
      return select;
    });
    pickers.forEach((s) => s.addEventListener("change", () => onPick(pickers[0].value, pickers[1].value)));
    box.append(form);
    const ps = body.prompts;
    const better = ps.filter((p) => p.diff > 1e-9).length;
    const worse = ps.filter((p) => p.diff < -1e-9).length;
    const d = body.a && body.b && body.a.mean_reward !== null ? body.b.mean_reward - body.a.mean_reward : NaN;
    box.append(
      text(
        "p",
        ps.length
          ? `${ps.length} prompt${ps.length === 1 ? "" : "s"} both answered: A ${armName(body.a)} mean ${fmt(body.a.mean_reward)}, B ${armName(body.b)} mean ${fmt(body.b.mean_reward)}, B − A ${signed(d)}; B better on ${better}, worse on ${worse}, equal on ${ps.length - better - worse}`
          : `no prompt that both ${armName(body.a)} and ${armName(body.b)} answered`,
        "note",
      ),
    );
    const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.id = "compare-chart";
    svg.setAttribute("class", "chart square");
    svg.setAttribute("role", "img");
    svg.setAttribute("aria-label", "mean reward per prompt, B against A");
    box.append(svg);
    const points = ps.map((p) => ({ x: p.a_mean, y: p.b_mean, label: `${p.prompt || "?"}: A ${fmt(p.a_mean)} (${p.a_runs} runs), B ${fmt(p.b_mean)} (${p.b_runs} runs)` }));
    svg.dataset.points = String(
      global.multiChart(svg, [{ name: "prompt", points, cls: "s0" }], { xMin: 0, xMax: 1, yMin: 0, yMax: 1, xLabel: `A = ${armName(body.a)} (above the diagonal: B better)`, line: false, xFree: true, diagonal: true, empty: "no shared prompt" }),
    );
    const table = document.createElement("table");
    table.id = "compare-table";
    const head = document.createElement("tr");
    for (const h of ["prompt", `A ${armName(body.a)}`, "runs", `B ${armName(body.b)}`, "runs", "B − A"]) head.append(text("th", h));
    table.append(document.createElement("thead"), document.createElement("tbody"));
    table.tHead.append(head);
    for (const p of ps) {
      const tr = document.createElement("tr");
      tr.append(
        text("td", p.prompt || "", "prompt"), text("td", fmt(p.a_mean), "num"), text("td", p.a_runs, "num"),
        text("td", fmt(p.b_mean), "num"), text("td", p.b_runs, "num"),
        text("td", signed(p.diff), `num ${p.diff > 1e-9 ? "up" : p.diff < -1e-9 ? "down" : ""}`),
      );
      table.tBodies[0].append(tr);
    }
    box.append(table);
    return body;
  }

  global.rlDig = { run: runPage, tokens, compare };
})(window);
