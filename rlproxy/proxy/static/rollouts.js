// The canary panel (/rollouts): the newest rollouts, and for the chosen one (`#id=N`) each arm's
// running mean reward by rewarded run; then the shadow checks (issue 54). Every value from the API is set with textContent (a policy
// name or a reason is data, never HTML); the page's CSP allows no inline script. The admin key is the
// dashboard's: its input field or `#key=` (a fragment, never sent), kept in localStorage.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  let key = localStorage.getItem("rlproxy.key") || "";
  const hash = () => new URLSearchParams(window.location.hash.replace(/^#/, ""));
  {
    const h = hash();
    if (h.get("key")) {
      key = h.get("key");
      localStorage.setItem("rlproxy.key", key);
      h.delete("key");
      history.replaceState(null, "", `${window.location.pathname}${h.toString() ? `#${h}` : ""}`);
    }
  }
  const fmt = (v) => (v === null || v === undefined ? "" : typeof v === "number" ? v.toFixed(3) : String(v));

  function cell(value, cls) {
    const td = document.createElement("td");
    if (cls) td.className = cls;
    td.textContent = value === null || value === undefined ? "" : String(value);
    return td;
  }

  function draw(series) {
    const lines = ["candidate", "incumbent"].map((arm) => {
      let sum = 0;
      const pts = series.filter((s) => s.arm === arm).map((s, i) => {
        sum += s.reward;
        return { x: i + 1, y: sum / (i + 1), label: `${arm}: run ${i + 1}, running mean ${fmt(sum / (i + 1))}` };
      });
      return { name: arm, points: pts, cls: `arm-${arm}` };
    });
    const svg = $("chart");
    svg.dataset.points = String(window.multiChart(svg, lines, { yMin: 0, yMax: 1, xLabel: "rewarded run of the arm", empty: "no rewarded run yet" }));
  }

  async function load() {
    const headers = key ? { Authorization: `Bearer ${key}` } : {};
    const id = hash().get("id");
    const r = await fetch(`v1/training/rollouts${id ? `?id=${encodeURIComponent(id)}` : ""}`, { headers });
    if (r.status === 401 || r.status === 403) {
      $("auth").hidden = false;
      $("error").textContent = "this proxy needs its admin key (RLPROXY_ADMIN_KEY): enter it above";
      return;
    }
    if (!r.ok) throw new Error(`v1/training/rollouts: HTTP ${r.status}`);
    const body = await r.json();
    $("error").textContent = "";
    const tbody = $("rows").tBodies[0];
    tbody.replaceChildren();
    for (const x of body.data) {
      const tr = document.createElement("tr");
      tr.className = "run";
      tr.dataset.id = String(x.id);
      tr.append(
        cell(x.id), cell(x.policy), cell(x.candidate_step), cell(x.incumbent_step), cell(x.status), cell(x.looks),
        cell(`${x.candidate_runs ?? ""} / ${x.incumbent_runs ?? ""}`),
        cell(`${fmt(x.candidate_reward)} / ${fmt(x.incumbent_reward)}`), cell(x.reason || "", "reason"),
      );
      tr.addEventListener("click", () => (window.location.hash = `id=${x.id}`));
      tbody.append(tr);
    }
    $("rows-note").textContent = body.data.length ? "" : "no rollout yet: one starts when a new step is trained with rollouts on";
    const sh = await fetch("v1/training/shadow_checks", { headers });
    if (sh.ok) {
      $("shadow").tBodies[0].replaceChildren(...(await sh.json()).data.map((x) => {
        const tr = document.createElement("tr");
        tr.append(
          cell(x.id), cell(x.policy), cell(x.candidate_step), cell(x.serving_step), cell(x.prompts),
          cell(`${fmt(x.candidate_score)} / ${fmt(x.serving_score)}`), cell(fmt(x.margin)), cell(x.scorer),
          cell(x.status), cell(x.reason || "", "reason"),
        );
        return tr;
      }));
    }
    if (body.chart) {
      const c = body.chart;
      $("title").textContent = `rollout ${c.id} (${c.policy}): step ${c.candidate_step} vs ${c.incumbent_step}, ${c.status}`;
      draw(c.series);
    }
    document.body.dataset.loaded = "true";
  }

  const run = () => load().catch((e) => ($("error").textContent = String((e && e.message) || e)));
  $("key").value = key;
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    key = $("key").value.trim();
    localStorage.setItem("rlproxy.key", key);
    run();
  });
  window.addEventListener("hashchange", run);
  run();
  setInterval(run, 5000);
})();
