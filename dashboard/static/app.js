// iotlake dashboard: polls the JSON API every few seconds and renders with plain DOM + SVG.
"use strict";

const REFRESH_MS = 5000;
const SVG_NS = "http://www.w3.org/2000/svg";
const state = { q: "", status: "", site: "", label: "", page: 1, size: 25, total: 0, device: null, hours: 6 };

// A token may be passed as #token=... (fragments never reach the server or its logs).
const hash = new URLSearchParams(location.hash.slice(1));
if (hash.get("token")) {
  sessionStorage.setItem("iotlake-token", hash.get("token"));
  hash.delete("token");
  history.replaceState(null, "", location.pathname + (hash.toString() ? "#" + hash : ""));
}
if (hash.get("device")) state.device = hash.get("device");

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else if (k.startsWith("on")) e[k] = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c ?? ""));
  return e;
}

function svg(tag, attrs = {}) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

async function api(path) {
  const headers = {};
  const token = sessionStorage.getItem("iotlake-token");
  if (token) headers.Authorization = "Bearer " + token;
  const r = await fetch(path, { headers });
  if (r.status === 401) { $("auth").hidden = false; throw new Error("unauthorized"); }
  if (!r.ok) throw new Error(`${path}: ${r.status} ${(await r.json().catch(() => ({}))).detail || ""}`);
  return r.json();
}

const fmtTime = (iso) => iso ? new Date(iso).toISOString().slice(11, 19) : "–";
const fmtDateTime = (iso) => iso ? new Date(iso).toISOString().replace("T", " ").slice(0, 19) : "–";
const fmtNum = (v, d = 1) => v == null ? "–" : Number(v).toLocaleString(undefined, { maximumFractionDigits: d });
const badge = (status) => el("span", { class: "badge " + status, "data-status": status }, status);

function renderFleet(f) {
  const cards = [el("div", { class: "card total" },
    el("div", { class: "n", "data-count": "total" }, fmtNum(f.total, 0)), el("div", { class: "label" }, "devices"))];
  const order = (s) => { const i = ["online", "degraded", "offline"].indexOf(s); return i < 0 ? 9 : i; };
  const statuses = Object.entries(f.by_status).sort((a, b) => order(a[0]) - order(b[0]) || a[0].localeCompare(b[0]));
  for (const [status, n] of statuses) {
    cards.push(el("div", { class: "card " + status },
      el("div", { class: "n", "data-count": status }, fmtNum(n, 0)), el("div", { class: "label" }, status)));
  }
  $("fleet").replaceChildren(...cards);
  const sel = $("status");
  for (const [status] of statuses) {
    if (![...sel.options].some((o) => o.value === status)) sel.append(el("option", { value: status }, status));
  }
  const sites = $("site");
  for (const site of f.sites || []) {
    if (![...sites.options].some((o) => o.value === site)) sites.append(el("option", { value: site }, site));
  }
}

// A device's labels (the registry's) as chips; a revoked device's mark.
const labelChips = (x) => [
  ...Object.entries(x.labels || {}).map(([k, v]) => chip(`${k}=${v}`, { "data-label": `${k}=${v}` })),
  ...(x.revoked_at ? [chip("revoked", { "data-flag": "revoked", title: x.revoked_at })] : []),
];

function renderDevices(d) {
  state.total = d.total;
  $("devices").replaceChildren(...d.items.map((x) => el("tr", {
    "data-device": x.device_id, class: x.device_id === state.device ? "selected" : "",
    onclick: () => selectDevice(x.device_id),
  }, el("td", {}, x.device_id), el("td", {}, badge(x.status),
     x.status !== "online" && x.status_reason ? el("span", { class: "muted reason" }, " " + x.status_reason) : ""),
     el("td", { "data-site": x.site || "" }, x.site || ""), el("td", { class: "labels" }, ...labelChips(x)),
     el("td", { title: x.status_since }, fmtDateTime(x.status_since)), el("td", {}, fmtTime(x.last_seen)))));
  const pages = Math.max(1, Math.ceil(d.total / state.size));
  $("page-info").textContent = `${d.total.toLocaleString()} devices · page ${state.page} / ${pages}`;
  $("prev").disabled = state.page <= 1;
  $("next").disabled = state.page >= pages;
  if (!state.device && d.items.length) selectDevice(d.items[0].device_id);
}

function chart(metric, series, points, anomalies, t0, t1) {
  const W = Math.max(320, $("charts").clientWidth || 640), H = 150, L = 44, R = 8, T = 8, B = 18;
  const s = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, "data-metric": metric });
  const ys = [...(series?.min || []), ...(series?.max || []), ...(points?.v || []), ...anomalies.map((a) => a.value)]
    .filter((v) => v != null);
  if (!ys.length) {
    const t = svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle" });
    t.textContent = "no data in range";
    s.append(t);
    return s;
  }
  let lo = Math.min(...ys), hi = Math.max(...ys);
  if (hi - lo < 1e-9) { lo -= 1; hi += 1; }
  const pad = (hi - lo) * 0.08; lo -= pad; hi += pad;
  const x = (t) => L + (W - L - R) * (t - t0) / Math.max(1, t1 - t0);
  const y = (v) => T + (H - T - B) * (1 - (v - lo) / (hi - lo));
  for (let i = 0; i <= 3; i++) {
    const v = lo + (hi - lo) * i / 3;
    s.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: y(v), y2: y(v) }));
    const lab = svg("text", { x: L - 4, y: y(v) + 3, "text-anchor": "end" });
    lab.textContent = fmtNum(v, 1);
    s.append(lab);
  }
  for (let i = 0; i <= 4; i++) {
    const t = t0 + (t1 - t0) * i / 4;
    const lab = svg("text", { x: x(t), y: H - 4, "text-anchor": i === 0 ? "start" : i === 4 ? "end" : "middle" });
    lab.textContent = new Date(t).toISOString().slice(11, 16);
    s.append(lab);
  }
  if (series && series.t.length) {
    const up = series.t.map((t, i) => `${x(t).toFixed(1)},${y(series.max[i]).toFixed(1)}`);
    const down = series.t.map((t, i) => `${x(t).toFixed(1)},${y(series.min[i]).toFixed(1)}`).reverse();
    s.append(svg("polygon", { class: "band", points: up.concat(down).join(" ") }));
    s.append(svg("path", { class: "mean",
      d: "M" + series.t.map((t, i) => `${x(t).toFixed(1)},${y(series.mean[i]).toFixed(1)}`).join("L") }));
  }
  if (points) {
    points.t.forEach((t, i) => {
      if (points.v[i] != null) s.append(svg("circle", { class: "pt", cx: x(t).toFixed(1), cy: y(points.v[i]).toFixed(1), r: 1.3 }));
    });
  }
  for (const a of anomalies) {
    const m = svg("circle", { class: "anomaly-marker", cx: x(a.t), cy: y(a.value), r: 5,
      "data-anomaly": a.event_time, "data-metric": metric, "data-value": a.value });
    const tip = svg("title");
    tip.textContent = `anomaly ${fmtDateTime(a.event_time)}: ${fmtNum(a.value, 2)} (score ${fmtNum(a.score, 1)}, baseline ${fmtNum(a.baseline, 2)})`;
    m.append(tip);
    s.append(m);
  }
  return s;
}

function renderDevice(d) {
  const dev = d.device;
  $("device-title").textContent = dev.device_id;
  $("device-title").dataset.device = dev.device_id;
  $("device-status").className = "badge " + dev.status;
  $("device-status").dataset.status = dev.status;
  $("device-status").textContent = dev.status;
  const topics = (d.topics || []).filter((c) => dev[c]).map((c) => ` · ${c} ${dev[c]}`).join("");
  const why = dev.status_reason && dev.status !== "online" ? ` (${dev.status_reason})` : "";
  $("device-meta").textContent = `${why} since ${fmtDateTime(dev.status_since)}` +
    ` · last seen ${fmtDateTime(dev.last_seen)}` +
    (dev.last_received ? ` · received ${fmtTime(dev.last_received)}` : "") + topics +
    ` · ${d.anomalies.length} anomal${d.anomalies.length === 1 ? "y" : "ies"} in range` +
    (dev.registered === false ? " · not in the registry" : "") +
    Object.entries(dev.labels || {}).map(([k, v]) => ` · ${k}=${v}`).join("") +
    (dev.revoked_at ? ` · revoked ${fmtDateTime(dev.revoked_at)}` : "");
  // The x axis spans the requested range, or less when the device's data starts later.
  const t1 = Date.parse(dev.last_seen || new Date().toISOString());
  const metrics = d.metrics.map((m) => m.name);  // the telemetry model's gold metrics
  const units = Object.fromEntries(d.metrics.map((m) => [m.name, m.unit ? ` ${m.unit}` : ""]));
  const firsts = metrics.flatMap((m) => [d.series[m]?.t[0], d.points[m]?.t[0]]).filter((t) => t != null);
  const t0 = Math.max(Date.parse(d.since), Math.min(t1 - 60000, ...firsts));
  $("charts").replaceChildren(...metrics.map((m) => {
    const an = d.anomalies.filter((a) => a.metric === m);
    return el("figure", { class: "chart", "data-metric": m, "data-anomalies": an.length },
      el("figcaption", {}, `${m} · now ${fmtNum(dev[m], 2)}${units[m]}`), chart(m, d.series[m], d.points[m], an, t0, t1));
  }));
}

const link = (id) => el("a", { onclick: () => selectDevice(id), "data-link": id }, id);
const chip = (text, attrs = {}) => el("span", { class: "chip", ...attrs }, text);
const plural = (n, one, many) => `${fmtNum(n, 0)} ${n === 1 ? one : many}`;

function renderAlerts(a) {
  const counts = Object.entries(a.by_severity);
  $("alert-counts").replaceChildren(...counts.map(([s, n]) =>
    el("span", { class: "count " + s, "data-severity-count": s }, `${fmtNum(n, 0)} ${s}`)));
  $("alerts").replaceChildren(...a.items.map((x) => el("tr", {
    "data-alert": x.alert_id, "data-severity": x.severity, "data-rule": x.rule,
  }, el("td", {}, badge(x.severity)), el("td", { class: "rule" }, x.rule),
     el("td", {}, x.device_id ? link(x.device_id) : x.subject),
     el("td", { title: x.starts_at }, fmtDateTime(x.starts_at)),
     el("td", { class: "summary", title: x.summary || "" }, x.summary || ""),
     el("td", {}, fmtNum(x.value, 2)),
     el("td", {}, ...(x.acknowledged ? [chip("acked", { "data-flag": "acknowledged" })] : []),
        ...(x.silenced ? [chip("silenced", { "data-flag": "silenced" })] : [])))));
  if (!a.items.length) {
    $("alerts").append(el("tr", {}, el("td", { class: "muted", colspan: 7 },
      a.version < 0 ? "no alerts evaluated yet (iotlake run writes alerts_current)" : "no open alerts")));
  }
  $("alerts-more").textContent = a.total > a.items.length ? `${a.items.length} of ${a.total} shown` : "";
}

function subjects(t) {
  if (t.subjects === 1) return [t.device_id ? link(t.device_id) : el("span", {}, t.sample[0]), " ",
    el("span", { class: "muted" }, t.summary || "")];
  const more = t.subjects - t.sample.length;
  return [el("span", { class: "muted" }, `${plural(t.subjects, "subject", t.device_id ? "devices" : "subjects")}: `),
    ...t.sample.flatMap((s, i) => [i ? ", " : "", t.device_id ? link(s) : s]), more > 0 ? ` +${more}` : ""];
}

function renderEvents(e) {
  $("events-window").textContent = `(last ${e.hours} h)`;
  const tot = e.totals;
  const shown = (items, n, what) => items.length < n ? ` · the ${items.length} latest ${what} shown` : "";
  const at = tot.alert_transitions;
  $("alert-summary").textContent = at == null ? "" : plural(at, "transition", "transitions");
  $("alert-events").replaceChildren(...e.alert_transitions.map((t) => el("li", {
    "data-event": "alert", "data-rule": t.rule, "data-transition": t.transition, "data-subjects": t.subjects,
  }, el("time", {}, fmtDateTime(t.changed_at)), badge(t.severity), " ", el("b", {}, t.rule), " ",
     el("span", { class: "transition " + t.transition }, t.transition), " ", ...subjects(t),
     t.transitions > t.subjects ? chip(plural(t.transitions, "transition", "transitions")) : "")));
  if (!e.alert_transitions.length) $("alert-events").append(el("li", { class: "muted" }, "none"));

  const sc = tot.status_changes;
  $("status-summary").textContent = sc == null ? "" :
    `${plural(sc.changes, "change", "changes")} on ${plural(sc.devices, "device", "devices")}` +
    shown(e.status_changes, sc.devices, "devices");
  $("status-events").replaceChildren(...e.status_changes.map((c) => el("li", {
    "data-event": "status", "data-device": c.device_id, "data-changes": c.changes,
  }, el("time", {}, fmtDateTime(c.changed_at)), link(c.device_id), " ", badge(c.previous_status), " → ",
     badge(c.status), " ", el("span", { class: "muted" }, c.reason || ""),
     c.changes > 1 ? chip(plural(c.changes, "change", "changes"), { "data-flap": c.changes }) : "")));
  if (!e.status_changes.length) $("status-events").append(el("li", { class: "muted" }, "none"));

  const an = tot.anomalies;
  $("anomaly-summary").textContent = an == null ? "" :
    `${plural(an.count, "anomaly", "anomalies")} on ${plural(an.devices, "device", "devices")}`;
  $("anomaly-events").replaceChildren(...e.anomalies.map((a) => el("li", { "data-event": "anomaly" },
    el("time", {}, fmtDateTime(a.event_time)), link(a.device_id), " ",
    el("span", { class: "anomaly-text" }, `${a.metric} ${fmtNum(a.value, 2)}`),
    el("span", { class: "muted" }, ` (baseline ${fmtNum(a.baseline, 2)}, score ${fmtNum(a.score, 1)})`),
    a.count > 1 ? chip(plural(a.count, "reading", "readings")) : "")));
  if (!e.anomalies.length) $("anomaly-events").append(el("li", { class: "muted" }, "none"));
}

function renderPipeline(p) {
  $("queries").replaceChildren(...p.queries.map((q) => el("tr", { "data-query": q.query_name },
    el("td", {}, q.query_name), el("td", {}, q.batch_id), el("td", {}, fmtNum(q.input_rows_per_second)),
    el("td", {}, fmtNum(q.processed_rows_per_second)),
    el("td", {}, `${fmtNum(q.batch_duration_ms, 0)} (${fmtNum(q.avg_batch_duration_ms, 0)})`),
    el("td", {}, q.lag == null ? "–" : fmtNum(q.lag, 0)), el("td", {}, fmtTime(q.last_batch_at)))));
  $("quality").replaceChildren(...p.quality.map((q) => el("tr", { "data-expectation": q.expectation },
    el("td", {}, q.expectation), el("td", {}, q.column || ""), el("td", {}, fmtNum(q.evaluated, 0)),
    el("td", {}, fmtNum(q.failed, 0)), el("td", {}, q.quarantine_rate == null ? "–" : (100 * q.quarantine_rate).toFixed(3) + " %"))));
  $("quality-window").textContent = p.quality_window_hours ? `(last ${p.quality_window_hours} h)` : "";
}

function devicesUrl() {
  const p = new URLSearchParams({ q: state.q, status: state.status, site: state.site, label: state.label,
    page: state.page, size: state.size });
  return "/api/devices?" + p;
}

async function loadDevice() {
  if (!state.device) return;
  renderDevice(await api(`/api/device/${encodeURIComponent(state.device)}?hours=${state.hours}`));
}

function selectDevice(id) {
  state.device = id;
  for (const tr of $("devices").children) tr.classList.toggle("selected", tr.dataset.device === id);
  loadDevice().catch(showError);
}

function showError(err) {
  if (String(err.message) === "unauthorized") return;
  $("error").hidden = false;
  $("error").textContent = String(err.message || err);
}

async function refresh() {
  const jobs = [
    api("/api/fleet").then(renderFleet), api(devicesUrl()).then(renderDevices),
    api("/api/alerts?limit=200").then(renderAlerts), api("/api/events?limit=20").then(renderEvents),
    api("/api/pipeline").then(renderPipeline), loadDevice(),
  ];
  const results = await Promise.allSettled(jobs);
  const failed = results.find((r) => r.status === "rejected");
  if (failed) showError(failed.reason); else $("error").hidden = true;
  $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  document.body.dataset.loaded = "1";
}

let searchTimer;
$("q").addEventListener("input", () => {
  clearTimeout(searchTimer);
  searchTimer = setTimeout(() => {
    state.q = $("q").value.trim(); state.page = 1;
    api(devicesUrl()).then(renderDevices).catch(showError);
  }, 250);
});
$("status").addEventListener("change", () => {
  state.status = $("status").value; state.page = 1;
  api(devicesUrl()).then(renderDevices).catch(showError);
});
$("site").addEventListener("change", () => {
  state.site = $("site").value; state.page = 1;
  api(devicesUrl()).then(renderDevices).catch(showError);
});
let labelTimer;
$("label").addEventListener("input", () => {
  clearTimeout(labelTimer);
  labelTimer = setTimeout(() => {
    const v = $("label").value.trim();
    if (v && !/^[^=]+=/.test(v)) return;  // a label filter is k=v: wait for the "="
    state.label = v; state.page = 1;
    api(devicesUrl()).then(renderDevices).catch(showError);
  }, 250);
});
$("prev").onclick = () => { state.page--; api(devicesUrl()).then(renderDevices).catch(showError); };
$("next").onclick = () => { state.page++; api(devicesUrl()).then(renderDevices).catch(showError); };
$("hours").addEventListener("change", () => { state.hours = Number($("hours").value); loadDevice().catch(showError); });
$("token-save").onclick = () => {
  sessionStorage.setItem("iotlake-token", $("token").value);
  $("auth").hidden = true;
  refresh();
};

refresh();
setInterval(refresh, REFRESH_MS);
