// tensord's live pool dashboard: polls /api/state and redraws. No library, nothing fetched
// from anywhere but this server.
"use strict";

const POLL_MS = 1000;
const TOKEN_KEY = "tensord-dashboard-token";
const SVG = "http://www.w3.org/2000/svg";

function takeTokenFromFragment() {
  // a link like http://127.0.0.1:8080/#token=SECRET: keep it for this tab, drop it from the URL
  const match = /(?:^#|&)token=([^&]+)/.exec(location.hash);
  if (match) {
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
}

function formatBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
}

function tenantName(t) { return t === "" ? "(no auth)" : t; }

// The hues a tenant's blocks may take: none near the charts' line colours (dashboard.css),
// so no block reads as one of them: 45 degrees either side of the fragmentation red (1),
// 25 of the reserved green (123) and of the allocated blue (208).
const TENANT_HUE_RANGES = [[46, 98], [148, 183], [233, 316]];
const TENANT_HUES = TENANT_HUE_RANGES.reduce((n, [lo, hi]) => n + hi - lo, 0);

function tenantColour(t) {
  let h = 7;
  for (const c of t) h = (h * 31 + c.codePointAt(0)) >>> 0;
  let left = h % TENANT_HUES;
  for (const [lo, hi] of TENANT_HUE_RANGES) {
    if (left < hi - lo) return "hsl(" + (lo + left) + ", 65%, 50%)";
    left -= hi - lo;
  }
  return "hsl(" + TENANT_HUE_RANGES[0][0] + ", 65%, 50%)";
}

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function svgEl(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}

function renderTenants(rows) {
  const body = document.querySelector("#tenants tbody");
  body.replaceChildren();
  for (const row of rows) {
    for (const [device, u] of Object.entries(row.devices)) {
      const tr = el("tr", { "data-tenant": row.tenant });
      const name = el("td");
      name.append(el("span", { class: "swatch" }), tenantName(row.tenant));
      name.firstChild.style.background = tenantColour(row.tenant);
      tr.append(name, el("td", {}, row.sessions), el("td", {}, row.handles), el("td", {}, device),
        el("td", {}, formatBytes(u.allocated_bytes)), el("td", {}, formatBytes(u.peak_bytes)),
        el("td", {}, u.storages), el("td", {}, u.quota_bytes === null ? "—" : formatBytes(u.quota_bytes)));
      body.append(tr);
    }
  }
}

// What the fragmentation figure means (the pool's external_fragmentation.all).
const FRAGMENTATION_MEANING = "fragmentation: the share of the cache's free bytes that one " +
  "allocation could not use, 1 − max(largest free block, releasable) / free bytes. " +
  "Segments that hold no allocation are releasable and count as one block (the pool gives them " +
  "back and reserves one in their place when it needs room), so an idle cache reads 0.";

const CHART = { height: 150, left: 64, right: 12, top: 8, bottom: 22 };
const TIME_STEPS_S = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600];
const MAX_TIME_TICKS = 8;

// A round step for about `count` ticks up to `top`: 1, 2, 2.5 or 5 times a power of ten.
function niceStep(top, count) {
  const rough = top / count;
  const power = Math.pow(10, Math.floor(Math.log10(rough)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * power >= rough) return m * power;
  return 10 * power;
}

// Byte ticks in one unit (the largest the top reaches): [[value, label], ...].
function byteTicks(top) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (top >= 1024 && i < units.length - 1) { top /= 1024; i++; }
  const step = niceStep(top, 4), scale = Math.pow(1024, i), ticks = [];
  for (let v = 0; v <= top * 1.0001 + step; v += step) {
    ticks.push([v * scale, String(Math.round(v * 100) / 100) + " " + units[i]]);
    if (v >= top) break;
  }
  return ticks;
}

function clockLabel(t) {
  const d = new Date(t * 1000);
  return [d.getHours(), d.getMinutes(), d.getSeconds()].map(n => String(n).padStart(2, "0")).join(":");
}

// One chart: a y axis of its own (ticks: [[value, label]]), a time axis, and polylines.
function renderChart(name, points, width, ticks, lines) {
  const height = CHART.height;
  const svg = svgEl("svg", { class: "chart", "data-chart": name, width, height,
    viewBox: "0 0 " + width + " " + height });
  const x0 = CHART.left, x1 = width - CHART.right, y0 = height - CHART.bottom, y1 = CHART.top;
  const top = ticks[ticks.length - 1][0] || 1;
  const y = v => y0 - (y0 - y1) * Math.min(v / top, 1);
  const yAxis = svgEl("g", { class: "axis y-axis" });
  for (const [value, label] of ticks) {
    yAxis.append(svgEl("line", { class: "grid", x1: x0, x2: x1, y1: y(value), y2: y(value) }));
    const text = svgEl("text", { x: x0 - 6, y: y(value) + 3, "text-anchor": "end" });
    text.textContent = label;
    yAxis.append(text);
  }
  svg.append(yAxis, svgEl("line", { class: "frame", x1: x0, x2: x0, y1: y1, y2: y0 }),
    svgEl("line", { class: "frame", x1: x0, x2: x1, y1: y0, y2: y0 }));
  const timeAxis = svgEl("g", { class: "axis time-axis" });
  svg.append(timeAxis);
  if (points.length < 2) {
    const text = svgEl("text", { class: "waiting", x: (x0 + x1) / 2, y: (y0 + y1) / 2, "text-anchor": "middle" });
    text.textContent = "collecting samples (one a second)…";
    svg.append(text);
    return svg;
  }
  const t0 = points[0].t, t1 = points[points.length - 1].t, span = Math.max(t1 - t0, 1e-9);
  const x = t => x0 + (x1 - x0) * (t - t0) / span;
  const step = TIME_STEPS_S.find(s => span / s <= MAX_TIME_TICKS) || TIME_STEPS_S[TIME_STEPS_S.length - 1];
  for (let t = Math.ceil(t0 / step) * step; t <= t1; t += step) {
    timeAxis.append(svgEl("line", { class: "tick", x1: x(t), x2: x(t), y1: y0, y2: y0 + 4 }));
    const text = svgEl("text", { x: x(t), y: height - 6, "text-anchor": "middle" });
    text.textContent = clockLabel(t);
    timeAxis.append(text);
  }
  for (const [cls, value] of lines) {
    svg.append(svgEl("polyline", { class: cls,
      points: points.map(p => x(p.t).toFixed(1) + "," + y(value(p)).toFixed(1)).join(" ") }));
  }
  return svg;
}

function legend(names) {
  const box = el("div", { class: "legend" });
  for (const [cls, label] of names) {
    const item = el("span");
    item.append(el("span", { class: "swatch " + cls }), label);
    box.append(item);
  }
  return box;
}

// Memory in bytes and fragmentation (a ratio) on charts of their own, over one time axis.
function renderCharts(series, device, width) {
  const points = series.filter(s => s.devices[device]).map(s => ({ t: s.t, d: s.devices[device] }));
  const top = Math.max(1024, ...points.map(p => Math.max(p.d[0], p.d[1])));
  const memory = renderChart("memory", points, width, byteTicks(top),
    [["reserved", p => p.d[1]], ["allocated", p => p.d[0]]]);
  const ratio = [[0, "0"], [0.25, "0.25"], [0.5, "0.5"], [0.75, "0.75"], [1, "1"]];
  const fragmentation = renderChart("fragmentation", points, width, ratio,
    [["fragmentation", p => p.d[2]]]);
  const box = el("div", { class: "charts" });
  box.append(el("h3", {}, "Memory (bytes)"), legend([["allocated", "allocated"], ["reserved", "reserved"]]),
    memory, el("h3", {}, "Fragmentation (0 to 1)"), legend([["fragmentation", "fragmentation"]]),
    fragmentation);
  return box;
}

function renderSegments(device) {
  const box = el("div", { class: "segments" });
  const largest = Math.max(1, ...device.segments.map(s => s.total_size));
  for (const seg of device.segments) {
    const row = el("div", { class: "segment", "data-address": seg.address });
    const use = seg.allocated_size === 0 ? "free" : formatBytes(seg.allocated_size) + " allocated";
    row.append(el("span", { class: "label" }, seg.segment_type + " " + formatBytes(seg.total_size) + ": " + use));
    const bar = el("div", { class: "bar" });
    bar.style.width = Math.max(6, 80 * seg.total_size / largest) + "%";
    for (const b of seg.blocks) {
      const block = el("div", { class: "block " + (b.state === "active_allocated" ? "allocated" : "inactive"),
        "data-state": b.state, "data-tenant": b.tenant === null ? "" : b.tenant });
      block.style.width = (100 * b.size / seg.total_size) + "%";
      if (b.state === "active_allocated") block.style.background = tenantColour(b.tenant || "");
      block.title = b.state + " " + formatBytes(b.size) +
        (b.state === "active_allocated" ? " (requested " + formatBytes(b.requested_size) + ", tenant " + tenantName(b.tenant || "") + ")" : "");
      bar.append(block);
    }
    row.append(bar);
    box.append(row);
  }
  if (device.segment_count > device.segments.length) {
    box.append(el("div", { class: "more" }, (device.segment_count - device.segments.length) + " more segments not shown"));
  }
  return box;
}

// What the pool is doing, in words: an idle cache (nothing allocated) says so.
function poolState(d) {
  if (d.allocated_bytes > 0) {
    return ["busy", "In use: " + formatBytes(d.allocated_bytes) + " allocated of " +
      formatBytes(d.reserved_bytes) + " reserved."];
  }
  if (d.reserved_bytes === 0 && d.segment_count === 0) return ["idle", "Idle: nothing allocated, nothing reserved."];
  return ["idle", "Idle: nothing allocated. " + formatBytes(d.reserved_bytes) + " stays reserved in " +
    d.segment_count + " cached segment" + (d.segment_count === 1 ? "" : "s") + ", all free " +
    "(not fragmented: tensord empty-cache gives them back)."];
}

function renderDevices(state) {
  const root = document.getElementById("devices");
  const width = Math.max(480, (root.clientWidth || 800) - 34);
  root.replaceChildren();
  for (const d of state.devices) {
    const section = el("section", { class: "device", "data-device": d.name });
    section.append(el("h2", {}, "Device " + d.name + " (capacity " + formatBytes(d.capacity) + ")"));
    const [kind, words] = poolState(d);
    section.append(el("p", { class: "pool-state " + kind, "data-state": kind }, words));
    const figures = el("div", { class: "figures" });
    for (const [name, value] of [["allocated", formatBytes(d.allocated_bytes)], ["reserved", formatBytes(d.reserved_bytes)],
      ["releasable", formatBytes(d.releasable_bytes)],
      ["largest free block", formatBytes(d.largest_free_block_bytes)],
      ["fragmentation", d.external_fragmentation.toFixed(3)], ["segments", d.segment_count],
      ["OOMs", d.num_ooms], ["compactions", d.num_compactions]]) {
      const f = el("span", {}, name + ": ");
      f.append(el("b", { class: "figure", "data-figure": name }, String(value)));
      if (name === "fragmentation") f.title = FRAGMENTATION_MEANING;
      if (name === "releasable") f.title = "bytes of cached segments that hold no allocation";
      figures.append(f);
    }
    section.append(figures, el("p", { class: "definition" }, FRAGMENTATION_MEANING));
    section.append(renderCharts(state.series, d.name, width));
    const blocks = legend([["block inactive", "free block"]]);
    blocks.append(el("span", {}, "an allocated block has its tenant's colour (see Tenants)"));
    section.append(el("h3", {}, "Segments"), blocks, renderSegments(d));
    root.append(section);
  }
}

async function poll() {
  const status = document.getElementById("status");
  const token = sessionStorage.getItem(TOKEN_KEY);
  const headers = token ? { Authorization: "Bearer " + token } : {};
  try {
    const response = await fetch("/api/state", { headers, cache: "no-store" });
    if (response.status === 401) {
      document.getElementById("login").hidden = false;
      document.getElementById("main").hidden = true;
      status.textContent = token ? "token refused" : "token needed";
      return;
    }
    if (!response.ok) throw new Error("HTTP " + response.status);
    const state = await response.json();
    document.getElementById("login").hidden = true;
    document.getElementById("main").hidden = false;
    status.className = "status";
    status.textContent = "live · " + new Date(state.time * 1000).toLocaleTimeString();
    document.getElementById("sessions").textContent =
      "sessions: " + state.sessions.live + " live, " + state.sessions.lost + " lost";
    renderTenants(state.tenants);
    renderDevices(state);
  } catch (error) {
    status.className = "status error";
    status.textContent = "disconnected (" + error.message + ")";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

takeTokenFromFragment();
document.getElementById("login").addEventListener("submit", event => {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, document.getElementById("token").value);
});
poll();
