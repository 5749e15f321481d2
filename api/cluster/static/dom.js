// Building DOM nodes safely: every string becomes a text node (never HTML), so nothing the API
// returns (model names, errors, prompts) can inject markup.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") el.className = value;
    else if (name === "style") for (const [k, v] of Object.entries(value)) el.style.setProperty(k, v);
    else if (name === "dataset") Object.assign(el.dataset, value);
    else if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else if (value === true) el.setAttribute(name, "");
    else el.setAttribute(name, String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children) {
    if (child === undefined || child === null || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else if (child instanceof Node) el.append(child);
    else el.append(document.createTextNode(String(child)));
  }
}

export function $(id) {
  return document.getElementById(id);
}

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];
export function bytes(n) {
  if (n === null || n === undefined || !Number.isFinite(n)) return "?";
  let i = 0;
  let v = n;
  while (Math.abs(v) >= 1024 && i < UNITS.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${v >= 100 || i === 0 ? v.toFixed(0) : v.toFixed(1)} ${UNITS[i]}`;
}

export function percent(n) {
  return `${Math.round(Math.max(0, Math.min(100, n)))}%`;
}

// The projection's times may come without a zone (SQLite): they are UTC.
export function parseTime(text) {
  if (!text) return null;
  const zoned = /[zZ]|[+-]\d\d:?\d\d$/.test(text) ? text : `${text}Z`;
  const t = Date.parse(zoned);
  return Number.isNaN(t) ? null : new Date(t);
}

export function ago(date) {
  if (!date) return "never";
  const s = Math.max(0, (Date.now() - date.getTime()) / 1000);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  return `${Math.round(s / 3600)} h ago`;
}

export function clock(date) {
  return date ? date.toLocaleTimeString([], { hour12: false }) : "";
}

// A usage bar: label, value text, and a fill coloured by how full it is.
export function meter(label, fraction, valueText, title) {
  const f = Number.isFinite(fraction) ? Math.max(0, Math.min(1, fraction)) : 0;
  const level = f >= 0.9 ? "high" : f >= 0.7 ? "warn" : "ok";
  return h(
    "div",
    { class: "meter", title: title || undefined },
    h("div", { class: "meter-head" }, h("span", { class: "meter-label" }, label), h("span", { class: "meter-value" }, valueText)),
    h(
      "div",
      { class: "meter-track", role: "meter", "aria-label": label, "aria-valuemin": "0", "aria-valuemax": "100", "aria-valuenow": String(Math.round(f * 100)) },
      h("div", { class: `meter-fill ${level}`, style: { width: `${(f * 100).toFixed(1)}%` } }),
    ),
  );
}

export function pill(text, kind) {
  return h("span", { class: `pill ${kind || ""}` }, text);
}

// The colour class of a runner or instance state.
export function stateKind(state) {
  switch (state) {
    case "Ready":
    case "Running":
    case "placed":
    case "online":
    case "completed":
      return "good";
    case "Assigned":
    case "Downloading":
    case "Loading":
    case "requested":
    case "pending":
    case "running":
    case "deleting":
      return "busy";
    case "Failed":
    case "rejected":
    case "failed":
    case "timed_out":
      return "bad";
    default:
      return "muted";
  }
}
