// plot.js: a tiny SVG plotter, window.HalfmoonPlot = {line, bars}. Each call draws a new <svg> as wide
// as `div` into it, with svg[data-points]; the div redraws itself when its width changes.
(() => {
'use strict';
const CH = 6.4, TEXT = '#333', GRID = '#e2e2e2', AXIS = '#767676'; // CH: ~width of an 11px character
const ok = (v) => typeof v === 'number' && Number.isFinite(v);

// el(tag, attrs, parent, text): a new SVG element appended to parent (null attrs are skipped).
function el(tag, attrs, parent, text) {
  const n = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const k in attrs) if (attrs[k] != null) n.setAttribute(k, attrs[k]);
  if (text != null) n.textContent = text;
  return parent.appendChild(n);
}

// ticks(max): about 4 round values from 0 up to at least max.
function ticks(max) {
  if (!(max > 0)) max = 1;
  const raw = max / 4, mag = 10 ** Math.floor(Math.log10(raw)), f = raw / mag;
  const step = (f <= 1 ? 1 : f <= 2 ? 2 : f <= 2.5 ? 2.5 : f <= 5 ? 5 : 10) * mag, out = [0];
  while (out[out.length - 1] < max) out.push(+(out.length * step).toPrecision(12));
  return out;
}

// A div redraws when its width changes (in the next frame: no ResizeObserver loop errors).
const ro = window.ResizeObserver && new ResizeObserver((entries) => {
  for (const {target: d, contentRect: r} of entries) {
    if (r.width > 0 && Math.round(r.width) !== d._w && !d._q) {
      d._q = requestAnimationFrame(() => { d._q = 0; d._draw(); });
    }
  }
});

// mount(div, height, draw): draw(svg, width, height) into a fresh svg as wide as the div, now
// and on every resize.
function mount(div, H, draw) {
  div._draw = () => {
    div._w = Math.round(div.clientWidth);
    const W = Math.max(240, div._w || 320);
    const svg = el('svg', {viewBox: `0 0 ${W} ${H}`, role: 'img', 'font-size': 11}, document.createDocumentFragment());
    svg.style.cssText = 'display:block;width:100%;height:auto';
    draw(svg, W, H);
    div.replaceChildren(svg);
  };
  if (ro && !div._ro) { ro.observe(div); div._ro = 1; }
  div._draw();
}

// legend(svg, items, W): swatches (line, dashed line or box) and names, wrapping; returns its height.
function legend(svg, items, W) {
  let x = 8, y = 10;
  for (const it of items) {
    const name = String(it.name || ''), w = 34 + name.length * CH;
    if (x > 8 && x + w > W) { x = 8; y += 16; }
    if (it.bar) el('rect', {x, y: y - 5, width: 14, height: 10, fill: it.color}, svg);
    else el('line', {x1: x, x2: x + 16, y1: y, y2: y, stroke: it.color, 'stroke-width': 2.5, 'stroke-dasharray': it.dash}, svg);
    el('text', {x: x + 21, y: y + 4, fill: TEXT}, svg, name);
    x += w;
  }
  return y + 18;
}

// yAxis(svg, values, fmt, W, top, bottom): labelled grid lines; returns {L: left edge, y: value -> y}.
function yAxis(svg, vals, fmt, W, T, B) {
  const tk = ticks(Math.max(0, ...vals.filter(ok)) * 1.05), top = tk[tk.length - 1];
  const L = Math.min(80, 10 + Math.max(...tk.map((v) => fmt(v).length)) * CH), y = (v) => B - (v / top) * (B - T);
  for (const v of tk) {
    el('line', {x1: L, x2: W - 8, y1: y(v), y2: y(v), stroke: GRID}, svg);
    el('text', {x: L - 6, y: y(v) + 4, 'text-anchor': 'end', fill: TEXT}, svg, fmt(v));
  }
  el('line', {x1: L, x2: W - 8, y1: B, y2: B, stroke: AXIS}, svg);
  return {L, y};
}

// line(div, o): time series over the last o.span seconds (default 600) up to o.now.
//   o.t: bin start times (Unix s), o.binS: bin width; o.series: [{name, values, color, dash}],
//   null values are gaps (a lone point is a dot); o.threshold: {value, name} drawn as a dashed
//   red line (an SLO); o.fmt(v): tick label with units; o.label: accessible name.
function line(div, o) {
  mount(div, o.height || 210, (svg, W, H) => {
    const t = o.t || [], now = ok(o.now) ? o.now : t[t.length - 1] || 0, fmt = o.fmt || String;
    const span = Math.max(o.span || 600, t.length ? now - t[0] : 0), half = (o.binS || 0) / 2;
    const series = (o.series || []).map((s) => ({...s, values: s.values || []}));
    const thr = o.threshold && ok(o.threshold.value) ? {color: '#c53030', name: 'SLO', ...o.threshold} : null;
    const all = series.flatMap((s) => s.values.filter((v, i) => ok(v) && ok(t[i])));
    const T = legend(svg, [...series, ...(thr ? [{...thr, dash: '6 4'}] : [])], W), B = H - 22, R = W - 8;
    const {L, y} = yAxis(svg, [...all, thr ? thr.value : 0], fmt, W, T, B);
    const x = (ts) => R - (Math.max(0, now - ts - half) / span) * (R - L); // bin middles, <= now
    const step = [1, 2, 5, 10, 15, 30, 60].find((m) => span / 60 / m <= (R - L) / 46) || 60;
    for (let m = 0; m * 60 <= span + 1e-6; m += step) { // x axis: minutes before now
      const xx = R - ((m * 60) / span) * (R - L);
      el('line', {x1: xx, x2: xx, y1: B, y2: B + 4, stroke: AXIS}, svg);
      el('text', {x: xx, y: B + 16, 'text-anchor': m ? 'middle' : 'end', fill: TEXT}, svg, m ? `-${m}m` : 'now');
    }
    if (thr) el('line', {x1: L, x2: R, y1: y(thr.value), y2: y(thr.value), stroke: thr.color, 'stroke-width': 1.5, 'stroke-dasharray': '6 4'}, svg);
    for (const s of series) {
      let d = '', run = [];
      const end = () => { if (run.length === 1) el('circle', {cx: run[0][0], cy: run[0][1], r: 2.5, fill: s.color}, svg); run = []; };
      s.values.forEach((v, i) => {
        if (!ok(v) || !ok(t[i])) return end();
        const p = [x(t[i]).toFixed(1), y(v).toFixed(1)];
        d += (run.length ? 'L' : 'M') + p;
        run.push(p);
      });
      end();
      if (d) el('path', {d, fill: 'none', stroke: s.color, 'stroke-width': 2, 'stroke-dasharray': s.dash, 'stroke-linejoin': 'round'}, svg);
    }
    if (!all.length) el('text', {x: (L + R) / 2, y: (T + B) / 2, 'text-anchor': 'middle', fill: TEXT}, svg, 'no data yet');
    svg.setAttribute('data-points', all.length);
    const latest = series.map((s) => `${s.name} ${fmt(s.values.filter(ok).pop())}`).join(', ');
    svg.setAttribute('aria-label', `${o.label || 'chart'}, latest: ${latest}${thr ? `; ${thr.name}` : ''}`);
  });
}

// bars(div, o): a bar chart. o.values (null: no bar); o.labels: [[line1, line2], ...]; o.best: the
//   highlighted bar's index; o.fmt(v): tick and value label; o.names: {bar, best} for the legend;
//   o.label: accessible name. Labels sit on two lines, or turn vertical (thinned out) when the bars
//   are too narrow for them.
function bars(div, o) {
  mount(div, o.height || 260, (svg, W, H) => {
    const vals = o.values || [], n = vals.length, fmt = o.fmt || String, names = o.names || {bar: 'value', best: 'best'};
    const colour = '#4a6f9c', bestColour = '#2f855a';
    const labels = (o.labels || []).map((l) => [].concat(l).map(String));
    const T = legend(svg, [{name: names.bar, color: colour, bar: 1}, {name: names.best, color: bestColour, bar: 1}], W) + 6;
    const longest = Math.max(1, ...labels.map((l) => l.join(' ').length));
    const slot0 = (W - 60) / Math.max(1, n), rotate = Math.max(1, ...labels.flat().map((s) => s.length)) * CH > slot0 - 4;
    const B = rotate ? H - Math.min(110, 12 + longest * CH) : H - 34;
    const {L, y} = yAxis(svg, vals, fmt, W, T, B);
    const slot = (W - 8 - L) / Math.max(1, n), bw = Math.max(2, Math.min(48, slot * 0.7)), every = Math.ceil(13 / slot);
    vals.forEach((v, i) => {
      const cx = L + slot * (i + 0.5), best = i === o.best, l = labels[i] || [''], weight = best ? 600 : null;
      if (ok(v)) {
        const r = el('rect', {x: cx - bw / 2, y: y(v), width: bw, height: Math.max(0, B - y(v)), fill: best ? bestColour : colour}, svg);
        el('title', {}, r, `${l.join(' ')}: ${fmt(v)}${best ? ` (${names.best})` : ''}`);
        if (best) el('text', {x: cx, y: y(v) - 4, 'text-anchor': 'middle', fill: TEXT, 'font-weight': 600}, svg, fmt(v));
      }
      if (!rotate) l.forEach((s, k) => el('text', {x: cx, y: B + 14 + k * 13, 'text-anchor': 'middle', fill: TEXT, 'font-weight': weight}, svg, s));
      else if (best || (i % every === 0 && !(o.best >= 0 && Math.abs(i - o.best) < every))) {
        el('text', {x: cx + 4, y: B + 6, 'text-anchor': 'end', fill: TEXT, 'font-weight': weight,
          transform: `rotate(-90 ${cx + 4} ${B + 6})`}, svg, l.join(' '));
      }
    });
    svg.setAttribute('data-points', n);
    svg.setAttribute('aria-label', `${o.label || 'bar chart'}: ${n} bars` + (labels[o.best] ? `; ${names.best}: ${labels[o.best].join(' ')}, ${fmt(vals[o.best])}` : ''));
  });
}

window.HalfmoonPlot = {line, bars};
})();
