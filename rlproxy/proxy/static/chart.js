// A tiny SVG line chart: enough for "mean reward per training step", no library, no build step.
// lineChart(svg, points, opts) draws axes, a polyline and one <circle class="point"> per point.
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
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(+v.toFixed(10));
    return ticks;
  }

  // points: [{x: number, y: number, label?: string}], sorted or not.
  // opts: {yMin, yMax, xLabel, yLabel}
  function lineChart(svg, points, opts) {
    opts = opts || {};
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const width = svg.clientWidth || 640;
    const height = svg.clientHeight || 240;
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    const pad = { left: 44, right: 12, top: 10, bottom: 32 };
    const pts = points.filter((p) => Number.isFinite(p.x) && Number.isFinite(p.y)).sort((a, b) => a.x - b.x);
    if (!pts.length) {
      el("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty" }, svg).textContent =
        opts.empty || "no data yet";
      return 0;
    }
    const xs = pts.map((p) => p.x);
    const ys = pts.map((p) => p.y);
    let x0 = Math.min(...xs);
    let x1 = Math.max(...xs);
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    const y0 = opts.yMin !== undefined ? Math.min(opts.yMin, ...ys) : Math.min(...ys);
    let y1 = opts.yMax !== undefined ? Math.max(opts.yMax, ...ys) : Math.max(...ys);
    if (y1 === y0) y1 = y0 + 1;
    const sx = (x) => pad.left + ((x - x0) / (x1 - x0)) * (width - pad.left - pad.right);
    const sy = (y) => height - pad.bottom - ((y - y0) / (y1 - y0)) * (height - pad.top - pad.bottom);

    const axes = el("g", { class: "axes" }, svg);
    for (const t of niceTicks(y0, y1, 4)) {
      el("line", { x1: pad.left, x2: width - pad.right, y1: sy(t), y2: sy(t), class: "grid" }, axes);
      el("text", { x: pad.left - 6, y: sy(t) + 4, "text-anchor": "end" }, axes).textContent = String(t);
    }
    for (const t of niceTicks(x0, x1, 6).filter((t) => Number.isInteger(t))) {
      el("text", { x: sx(t), y: height - pad.bottom + 16, "text-anchor": "middle" }, axes).textContent = String(t);
    }
    if (opts.xLabel) {
      el("text", { x: width - pad.right, y: height - 4, "text-anchor": "end", class: "label" }, axes).textContent =
        opts.xLabel;
    }

    el("polyline", { class: "line", points: pts.map((p) => `${sx(p.x)},${sy(p.y)}`).join(" ") }, svg);
    const dots = el("g", { class: "points" }, svg);
    for (const p of pts) {
      const c = el("circle", { class: "point", cx: sx(p.x), cy: sy(p.y), r: 3.5, "data-x": p.x, "data-y": p.y }, dots);
      el("title", {}, c).textContent = p.label || `${p.x}: ${p.y}`;
    }
    return pts.length;
  }

  global.lineChart = lineChart;
})(window);
