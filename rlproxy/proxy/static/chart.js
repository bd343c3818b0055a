// A tiny SVG line chart: the dashboard's per-step curves, no library, no build step.
//   lineChart(svg, points, opts)    one series (the mean reward, with an optional ± std band)
//   multiChart(svg, series, opts)   several series on one axis (clip fractions low / high)
// opts.xTime: x values are times (ms since the epoch), labelled with their date and time;
// opts.marks: [{x, label}] vertical dashed lines (the SFT steps); a point's `cls` marks it (skipped).
// opts.line === false: points only, no line joining them (groups that are unrelated to each other);
// opts.xFree: x ticks at any value, not only integers (a scatter of two rewards); opts.xMin/xMax;
// opts.diagonal: the line y = x (a scatter of arm B against arm A); a point's `r` is its radius.
// Each point is a <circle class="point"> carrying data-x / data-y (and data-series), so tests and
// people can read the exact numbers back; a band is a <path class="band"> from each point's lo..hi.
"use strict";

(function (global) {
  const NS = "http://www.w3.org/2000/svg";

  function el(name, attrs, parent) {
    const node = document.createElementNS(NS, name);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (parent) parent.appendChild(node);
    return node;
  }

  function niceTicks(lo, hi, count) {
    if (hi <= lo) hi = lo + 1;
    const raw = (hi - lo) / Math.max(count, 1);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
    const ticks = [];
    // rounded relative to the step, so a KL axis at 1e-7 keeps its ticks (a fixed toFixed(10) would not)
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) {
      ticks.push(+(Math.round(v / step) * step).toPrecision(12));
    }
    return ticks;
  }

  // Axis labels with the precision the numbers have: 0.25, 1200, 3e-7, 2.5e+5.
  function tickLabel(t) {
    if (t === 0) return "0";
    const a = Math.abs(t);
    return a < 1e-3 || a >= 1e5 ? t.toExponential(1).replace(".0e", "e") : String(+t.toPrecision(4));
  }

  // series: [{points: [{x, y, lo?, hi?, label?}], name?, cls?}]
  // opts: {yMin, yMax, xLabel, band, empty}; returns the number of points drawn.
  function multiChart(svg, series, opts) {
    opts = opts || {};
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const width = svg.clientWidth || 640;
    const height = svg.clientHeight || 240;
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    const pad = { left: 52, right: 12, top: series.length > 1 ? 26 : 10, bottom: 32 };
    const lines = series.map((s) => ({
      ...s,
      pts: s.points.filter((p) => Number.isFinite(p.x) && Number.isFinite(p.y)).sort((a, b) => a.x - b.x),
    }));
    const all = lines.flatMap((s) => s.pts);
    if (!all.length) {
      el("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty" }, svg).textContent =
        opts.empty || "no data yet";
      return 0;
    }
    const banded = opts.band ? all.filter((p) => Number.isFinite(p.lo) && Number.isFinite(p.hi)) : [];
    const xs = [...all.map((p) => p.x), ...(opts.marks || []).map((m) => m.x).filter(Number.isFinite)];
    const ys = [...all.map((p) => p.y), ...banded.flatMap((p) => [p.lo, p.hi])];
    let x0 = opts.xMin !== undefined ? Math.min(opts.xMin, ...xs) : Math.min(...xs);
    let x1 = opts.xMax !== undefined ? Math.max(opts.xMax, ...xs) : Math.max(...xs);
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    let y0 = opts.yMin !== undefined ? Math.min(opts.yMin, ...ys) : Math.min(...ys);
    let y1 = opts.yMax !== undefined ? Math.max(opts.yMax, ...ys) : Math.max(...ys);
    if (y1 === y0) {
      const d = y0 !== 0 ? Math.abs(y0) * 0.5 : 1; // a flat series: centred, at its own scale
      y1 = y0 + d;
      if (opts.yMin === undefined) y0 -= d;
    }
    const sx = (x) => pad.left + ((x - x0) / (x1 - x0)) * (width - pad.left - pad.right);
    const sy = (y) => height - pad.bottom - ((y - y0) / (y1 - y0)) * (height - pad.top - pad.bottom);

    const axes = el("g", { class: "axes" }, svg);
    for (const t of niceTicks(y0, y1, 4)) {
      el("line", { x1: pad.left, x2: width - pad.right, y1: sy(t), y2: sy(t), class: "grid" }, axes);
      el("text", { x: pad.left - 6, y: sy(t) + 4, "text-anchor": "end" }, axes).textContent = tickLabel(t);
    }
    if (opts.xTime) {
      const span = x1 - x0;
      for (let i = 0; i <= 4; i++) {
        const t = x0 + (span * i) / 4;
        const d = new Date(t);
        const day = d.toLocaleDateString(undefined, { month: "short", day: "numeric" });
        const time = d.toLocaleTimeString(undefined, { hour: "2-digit", minute: "2-digit", second: span < 600e3 ? "2-digit" : undefined });
        const anchor = i === 0 ? "start" : i === 4 ? "end" : "middle";
        el("text", { x: sx(t), y: height - pad.bottom + 16, "text-anchor": anchor }, axes).textContent = `${day} ${time}`;
      }
    } else {
      for (const t of niceTicks(x0, x1, 6).filter((t) => opts.xFree || Number.isInteger(t))) {
        el("text", { x: sx(t), y: height - pad.bottom + 16, "text-anchor": "middle" }, axes).textContent = opts.xFree ? tickLabel(t) : String(t);
      }
    }
    for (const m of opts.marks || []) {
      if (!Number.isFinite(m.x) || m.x < x0 || m.x > x1) continue;
      const line = el("line", { x1: sx(m.x), x2: sx(m.x), y1: pad.top, y2: height - pad.bottom, class: "mark", "data-x": m.x }, svg);
      el("title", {}, line).textContent = m.label || "";
      el("text", { x: sx(m.x) - 3, y: pad.top + 10, class: "mark-label", "text-anchor": "end" }, svg).textContent = m.short || "";
    }
    if (opts.xLabel) {
      el("text", { x: width - pad.right, y: height - 4, "text-anchor": "end", class: "label" }, axes).textContent =
        opts.xLabel;
    }

    if (opts.diagonal) {
      const lo = Math.max(x0, y0);
      const hi = Math.min(x1, y1);
      if (hi > lo) el("line", { x1: sx(lo), y1: sy(lo), x2: sx(hi), y2: sy(hi), class: "diagonal" }, svg);
    }
    if (banded.length) {
      const upper = banded.map((p) => `${sx(p.x)},${sy(p.hi)}`);
      const lower = banded.map((p) => `${sx(p.x)},${sy(p.lo)}`).reverse();
      el("path", { class: "band", d: `M${upper.join("L")}L${lower.join("L")}Z` }, svg);
    }
    let drawn = 0;
    lines.forEach((s, i) => {
      if (!s.pts.length) return;
      const cls = s.cls || `s${i}`;
      if (opts.line !== false) {
        el("polyline", { class: `line ${cls}`, points: s.pts.map((p) => `${sx(p.x)},${sy(p.y)}`).join(" ") }, svg);
      }
      const dots = el("g", { class: "points" }, svg);
      for (const p of s.pts) {
        const attrs = { class: `point ${cls}${p.cls ? ` ${p.cls}` : ""}`, cx: sx(p.x), cy: sy(p.y), r: p.r || 3.5, "data-x": p.x, "data-y": p.y };
        if (p.id !== undefined) attrs["data-id"] = p.id;
        if (s.name) attrs["data-series"] = s.name;
        const c = el("circle", attrs, dots);
        el("title", {}, c).textContent = p.label || `${s.name ? `${s.name} ` : ""}${p.x}: ${p.y}`;
      }
      drawn += s.pts.length;
    });
    if (lines.length > 1) {
      const legend = el("g", { class: "legend" }, svg);
      let x = pad.left;
      lines.forEach((s, i) => {
        const cls = s.cls || `s${i}`;
        if (opts.line === false) el("circle", { cx: x + 7, cy: 8, r: 3.5, class: `key ${cls}` }, legend);
        else el("line", { x1: x, x2: x + 14, y1: 8, y2: 8, class: `line ${cls}` }, legend);
        const label = el("text", { x: x + 18, y: 12 }, legend);
        label.textContent = s.name || `series ${i + 1}`;
        x += 30 + 7 * label.textContent.length;
      });
    }
    return drawn;
  }

  // One series; points may carry lo/hi for a band (opts.band).
  function lineChart(svg, points, opts) {
    return multiChart(svg, [{ points, cls: "s0" }], opts);
  }

  global.lineChart = lineChart;
  global.multiChart = multiChart;
  global.tickLabel = tickLabel;
})(window);
