// Drawing helpers of the Flywheel dashboard (dashboard.js): DOM and SVG elements built with
// textContent and attribute setters only (text from the API never becomes markup), number and time
// formats, and an SVG chart frame with axes, grid lines and scales.

export const SVG_NS = "http://www.w3.org/2000/svg";
export const PALETTE = ["#2563eb", "#db2777", "#16a34a", "#ea580c", "#7c3aed", "#0891b2", "#ca8a04",
  "#dc2626", "#4f46e5", "#059669", "#9333ea", "#64748b"];

// ---- DOM helpers ------------------------------------------------------------------------------

export function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "className") node.className = value;
    else if (name === "text") node.textContent = String(value);
    else if (name === "dataset") Object.assign(node.dataset, value);
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

export function titled(node, text) {
  node.append(svg("title", {}, text));
  return node;
}

export function fmt(value, digits = 3) {
  if (value === null || value === undefined) return "–";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value)) return value.toLocaleString();
  return Number(value.toPrecision(digits)).toString();
}

export function when(iso) {
  if (!iso) return "–";
  const moment = new Date(iso);
  return Number.isNaN(moment.getTime()) ? iso : moment.toLocaleString();
}

export function badge(text, kind) {
  return el("span", { className: `badge ${kind || text}`, text });
}

export function colourOf(index) {
  return PALETTE[index % PALETTE.length];
}

// ---- charts -----------------------------------------------------------------------------------

export function niceTicks(low, high, count) {
  if (!(high > low)) return [low];
  const raw = (high - low) / count;
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * power).find((s) => s >= raw) || raw;
  const ticks = [];
  for (let v = Math.ceil(low / step) * step; v <= high + step * 1e-9; v += step) ticks.push(Number(v.toPrecision(12)));
  return ticks;
}

export function padded(low, high) {
  if (low === high) return [low - 1, high + 1];
  const pad = (high - low) * 0.06;
  return [low - pad, high + pad];
}

export function timeLabel(seconds, span) {
  const moment = new Date(seconds * 1000);
  const hm = moment.toLocaleTimeString([], span < 600
    ? { hour: "2-digit", minute: "2-digit", second: "2-digit" } : { hour: "2-digit", minute: "2-digit" });
  return span > 86400 ? `${moment.getMonth() + 1}/${moment.getDate()} ${hm}` : hm;
}

// An SVG frame with axes and grid lines; returns the SVG and the scales into it.
export function frame(container, xDomain, yDomain, options) {
  const width = Math.max(container.clientWidth || 0, 320);
  const height = options.height || 240;
  const margin = { left: 48, right: 12, top: 10, bottom: 26 };
  const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": options.label || "chart" });
  const [x0, x1] = xDomain;
  const [y0, y1] = yDomain;
  const x = (v) => margin.left + ((v - x0) / (x1 - x0 || 1)) * (width - margin.left - margin.right);
  const y = (v) => height - margin.bottom - ((v - y0) / (y1 - y0 || 1)) * (height - margin.top - margin.bottom);
  for (const tick of niceTicks(y0, y1, 4)) {
    root.append(svg("line", { class: "grid-line", x1: margin.left, x2: width - margin.right, y1: y(tick), y2: y(tick) }));
    root.append(svg("text", { x: margin.left - 6, y: y(tick) + 3, "text-anchor": "end" }, fmt(tick)));
  }
  const xTicks = options.xTicks || niceTicks(x0, x1, 5);
  for (const tick of xTicks) {
    if (tick < x0 || tick > x1) continue;
    const at = Math.min(Math.max(x(tick), margin.left + 20), width - margin.right - 20); // labels stay inside
    root.append(svg("text", { x: at, y: height - 8, "text-anchor": "middle" },
      options.xLabel ? options.xLabel(tick) : fmt(tick)));
  }
  root.append(svg("line", { class: "axis", x1: margin.left, x2: margin.left, y1: margin.top, y2: height - margin.bottom }));
  root.append(svg("line", { class: "axis", x1: margin.left, x2: width - margin.right, y1: height - margin.bottom, y2: height - margin.bottom }));
  return { root, x, y, width, height, margin };
}

export function emptyChart(container, message) {
  container.replaceChildren(el("p", { className: "muted empty", text: message }));
}

export function rollingMean(values, window) {
  const out = [];
  let sum = 0;
  for (let i = 0; i < values.length; i += 1) {
    sum += values[i];
    if (i >= window) sum -= values[i - window];
    out.push(sum / Math.min(i + 1, window));
  }
  return out;
}
