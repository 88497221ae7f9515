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

function tenantColour(t) {
  let h = 7;
  for (const c of t) h = (h * 31 + c.codePointAt(0)) >>> 0;
  return "hsl(" + (h % 360) + ", 65%, 55%)";
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

function renderChart(series, device, capacity) {
  const width = 800, height = 160, pad = 4;
  const svg = svgEl("svg", { class: "chart", viewBox: "0 0 " + width + " " + height, preserveAspectRatio: "none" });
  const points = series.filter(s => s.devices[device]);
  if (points.length < 2) return svg;
  const t0 = points[0].t, t1 = points[points.length - 1].t;
  const top = Math.max(1, ...points.map(s => s.devices[device][1]));
  const x = t => pad + (width - 2 * pad) * (t - t0) / Math.max(t1 - t0, 1e-9);
  const y = v => height - pad - (height - 2 * pad) * v;
  const line = (cls, value) => svgEl("polyline", {
    class: cls, points: points.map(s => x(s.t).toFixed(1) + "," + y(value(s.devices[device])).toFixed(1)).join(" "),
  });
  svg.append(line("reserved", d => d[1] / top), line("allocated", d => d[0] / top),
    line("fragmentation", d => d[2]));
  const label = svgEl("text", { x: pad + 2, y: 12 });
  label.textContent = formatBytes(top) + " (fragmentation: 0–1)";
  svg.append(label);
  return svg;
}

function renderSegments(device) {
  const box = el("div", { class: "segments" });
  const largest = Math.max(1, ...device.segments.map(s => s.total_size));
  for (const seg of device.segments) {
    const row = el("div", { class: "segment", "data-address": seg.address });
    row.append(el("span", { class: "label" },
      seg.segment_type + " " + formatBytes(seg.total_size) + " · " + formatBytes(seg.allocated_size)));
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

function renderDevices(state) {
  const root = document.getElementById("devices");
  root.replaceChildren();
  for (const d of state.devices) {
    const section = el("section", { class: "device", "data-device": d.name });
    section.append(el("h2", {}, "Device " + d.name + " (capacity " + formatBytes(d.capacity) + ")"));
    const figures = el("div", { class: "figures" });
    for (const [name, value] of [["allocated", formatBytes(d.allocated_bytes)], ["reserved", formatBytes(d.reserved_bytes)],
      ["largest free block", formatBytes(d.largest_free_block_bytes)],
      ["fragmentation", d.external_fragmentation.toFixed(3)], ["segments", d.segment_count],
      ["OOMs", d.num_ooms], ["compactions", d.num_compactions]]) {
      const f = el("span", {}, name + ": ");
      f.append(el("b", { class: "figure", "data-figure": name }, String(value)));
      figures.append(f);
    }
    section.append(figures);
    const legend = el("div", { class: "legend" });
    for (const name of ["allocated", "reserved", "fragmentation"]) {
      const item = el("span");
      item.append(el("span", { class: "swatch " + name }), name);
      legend.append(item);
    }
    const free = el("span");
    free.append(el("span", { class: "swatch block inactive" }), "free block");
    legend.append(free);
    section.append(legend, renderChart(state.series, d.name, d.capacity), renderSegments(d));
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
