// app.js: the Halfmoon dashboard (docs/DASHBOARD.md): #live polls the cluster every second, #sizing
// runs a simulator sweep. Server data goes into the page as textContent only, never as HTML.
(() => {
'use strict';
const Plot = window.HalfmoonPlot, DASH = '—';
const $ = (sel, root = document) => root.querySelector(sel);
const isNum = (v) => typeof v === 'number' && Number.isFinite(v);
const nf = (o) => new Intl.NumberFormat('en-US', o), fd = (n) => nf({maximumFractionDigits: n});
const F0 = fd(0), F1 = fd(1), F2 = fd(2), F3 = fd(3), F4 = fd(4), S2 = nf({maximumSignificantDigits: 2}),
  COMPACT = nf({notation: 'compact'}), PCT = nf({style: 'percent', maximumFractionDigits: 1});
const TIME = new Intl.DateTimeFormat('en-GB', {hour: '2-digit', minute: '2-digit', second: '2-digit'});

// formatters: numbers with units, "—" for null
const num = (v, f = F0, unit = '') => (isNum(v) ? f.format(v) + unit : DASH);
const int = (v) => num(v);
const rps = (v) => num(v, F2, ' req/s');
const share = (v) => num(v, PCT);
const small = (v) => num(v, Math.abs(v) < 1 ? S2 : F2);
const ms = (v) => (v >= 1000 ? num(v / 1000, F2, ' s') : num(v, v >= 10 ? F0 : S2, ' ms'));
const kTokens = (v) => (v >= 1024 && v % 1024 === 0 ? `${v / 1024}k` : num(v, COMPACT));
function bytes(v) {
  let i = 0;
  while (Math.abs(v) >= 1000 && i < 4) { v /= 1000; i++; }
  return num(v, i ? F1 : F0, ` ${['B', 'kB', 'MB', 'GB', 'TB'][i]}`);
}
const bytesPerS = (v) => (isNum(v) ? `${bytes(v)}/s` : DASH);

// setText(el, s): touches the DOM only when the text changes.
const setText = (el, s) => { if (el && el.textContent !== s) el.textContent = s; };
// h(tag, attrs, ...children): a new element; strings become text nodes.
function h(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const k in attrs) if (attrs[k] != null) e.setAttribute(k, attrs[k]);
  e.append(...kids);
  return e;
}

// api(url, init): the JSON answer, or throws Error(the API's error.message) with .status; 401: log in.
async function api(url, init = {}) {
  const res = await fetch(url, {credentials: 'same-origin', cache: 'no-store', signal: AbortSignal.timeout(10000),
    ...init, headers: {Accept: 'application/json', ...init.headers}}).catch((e) => {
    throw new Error(e.name === 'TimeoutError' ? 'no answer within 10 s' : 'network error');
  });
  if (res.status === 401) { signIn(); throw Object.assign(new Error('not signed in'), {auth: true}); }
  const body = await res.json().catch(() => null), err = body && body.error;
  if (!res.ok) {
    throw Object.assign(new Error((err && err.message) || `HTTP ${res.status} ${res.statusText}`.trim()),
      {status: res.status, param: err && err.param});
  }
  if (!body || typeof body !== 'object') throw new Error('the answer was not JSON');
  return body;
}

// signIn(): /dashboard shows the login form while we have no valid token.
const signIn = () => location.assign('/dashboard');

const banner = $('#banner');
function showBanner(reason) {
  banner.hidden = false;
  setText(banner, `cannot reach the cluster: ${reason}, retrying`);
}
const hideBanner = () => { banner.hidden = true; };

// == views
const views = {live: $('#view-live'), sizing: $('#view-sizing')};
let view = 'live';
function route() {
  const want = location.hash.slice(1);
  if (want === 'live' || want === 'sizing') view = want;
  for (const name in views) views[name].hidden = name !== view;
  for (const a of document.querySelectorAll('nav a')) {
    if (a.hash === `#${view}`) a.setAttribute('aria-current', 'page'); else a.removeAttribute('aria-current');
  }
  if (view === 'live') startLive(); else stopLive();
  if (view === 'sizing') loadOptions();
}
addEventListener('hashchange', route);
document.addEventListener('visibilitychange', () => (document.hidden ? stopLive() : startLive()));

// == live view
// One poll loop at a time: stopLive() bumps liveGen, which ends the old loop.
let liveGen = 0, liveTimer = null, liveOn = false;
const liveWanted = () => view === 'live' && !document.hidden;
function startLive() { if (!liveOn && liveWanted()) { liveOn = true; pollLive(++liveGen); } }
function stopLive() { liveOn = false; liveGen++; clearTimeout(liveTimer); }
async function pollLive(gen) {
  const started = Date.now();
  try {
    const data = await api('/dashboard/api/live');
    if (gen !== liveGen) return;
    renderLive(data);
    hideBanner();
  } catch (e) {
    if (gen !== liveGen || e.auth) return;
    showBanner(e.message);
  }
  if (gen !== liveGen) return;
  if (liveWanted()) liveTimer = setTimeout(pollLive, Math.max(100, 1000 - (Date.now() - started)), gen);
  else liveOn = false;
}

const live = views.live;
const put = (name, text) => setText($(`[data-field="${name}"]`, live), text);

function renderLive(d) {
  const c = d.cluster || {}, s = d.series || {}, slo = d.slo || {}, hits = c.prefix_hits || {};
  const mi = d.model_info || {};
  put('model', d.model ? [d.model, mi.architecture, mi.dtype].filter(Boolean).join(' · ') : DASH);
  put('mode', d.mode || DASH);
  put('ready', d.ready ? 'ready' : 'not ready');
  $('[data-field="ready"]', live).classList.toggle('bad', !d.ready);
  put('admission', (d.admission && d.admission.policy) || DASH);
  put('updated', isNum(d.now) ? TIME.format(d.now * 1000) : DASH);
  put('request_rate', rps(c.request_rate));
  put('goodput_rps', rps(c.goodput_rps));
  put('slo_attainment', share(c.slo_attainment));
  for (const k of ['requests_running', 'requests_waiting', 'finished', 'errors']) put(k, int(c[k]));
  for (const k of ['device', 'host', 'disk', 'remote', 'total']) put(`hit_${k}`, share(hits[k]));
  const rej = Object.entries(c.rejected || {}).filter(([, n]) => n), list = $('[data-field="rejected"]', live);
  const key = JSON.stringify(rej);
  if (list.dataset.key !== key) {
    list.dataset.key = key;
    list.replaceChildren(...(rej.length ? rej.map(([why, n]) => h('li', {}, h('span', {}, why), ' ', h('b', {}, int(n))))
      : [h('li', {}, 'none')]));
  }

  renderWorkers(Array.isArray(d.workers) ? d.workers : []);
  renderAdapters(d.lora);
  renderPlanner(d.planner, d.now);

  const base = {t: s.t, now: d.now, binS: s.bin_s, span: 600};
  const pct = (o) => ['p50', 'p90', 'p99'].map((p, i) => ({name: p, values: (o || {})[p], color: ['#2b6cb0', '#b35309', '#7b2d8e'][i]}));
  Plot.line($('#ttft-chart'), {...base, fmt: ms, label: 'Time to first token', series: pct(s.ttft_ms),
    threshold: {value: slo.ttft_ms, name: `SLO ${ms(slo.ttft_ms)}`}});
  Plot.line($('#tbt-chart'), {...base, fmt: ms, label: 'Time between tokens', series: pct(s.tbt_ms),
    threshold: {value: slo.tbt_ms, name: `SLO ${ms(slo.tbt_ms)}`}});
  Plot.line($('#rate-chart'), {...base, fmt: (v) => num(v, F2, '/s'), label: 'Requests per second', series: [
    {name: 'requests', values: s.request_rate, color: '#2b6cb0'},
    {name: 'goodput', values: s.goodput_rps, color: '#2f855a'},
    {name: 'rejected', values: s.rejected_rps, color: '#c53030', dash: '2 3'}]});
}

// == LoRA adapters: one row each (requests since start, the workers holding it), hidden when none
function renderAdapters(lora) {
  const panel = $('#lora-panel'), rows = lora && Array.isArray(lora.adapters) ? lora.adapters : [];
  panel.hidden = !rows.length;
  if (!rows.length) return;
  const key = JSON.stringify(rows), body = $('#lora-table tbody');
  if (body.dataset.key !== key) {
    body.dataset.key = key;
    body.replaceChildren(...rows.map((a) => h('tr', {class: a.loaded ? '' : 'muted'},
      h('td', {}, String(a.name), a.loaded ? '' : ' (unloaded)'), h('td', {}, a.rank == null ? DASH : int(a.rank)),
      h('td', {}, int(a.requests)), h('td', {}, (a.held_by || []).join(', ') || 'none yet'))));
  }
  put('lora_changes', `${int(lora.loads)} loaded, ${int(lora.unloads)} unloaded since start`);
}

// == planner: mode, split now vs desired, the pools over time (a step plot), the decisions newest
// first (moves highlighted, holds dimmed); hidden when the server runs none (off, co-located)
const PLANNER_ROWS = 50;
const splitOf = (text) => (String(text).match(/^(\d+)P(\d+)D$/) || []).slice(1).map(Number);
const splitText = (p, d) => (isNum(p) && isNum(d) ? `${p}P${d}D` : DASH);
const signed = (v) => (isNum(v) && v ? `${v > 0 ? '+' : ''}${num(v, PCT)}` : DASH);

function renderPlanner(p, now) {
  const panel = $('#planner-panel');
  panel.hidden = !p;
  if (!p) return;
  const ds = Array.isArray(p.decisions) ? p.decisions : [], want = p.desired || {};
  put('planner_mode', `${p.mode || DASH}${p.busy ? ' · moving a worker' : ''}`);
  put('planner_split', splitText(p.prefill, p.decode));
  put('planner_desired', splitText(want.prefill, want.decode));
  $('[data-field="planner_desired"]', live).classList.toggle('differs', want.prefill !== p.prefill || want.decode !== p.decode);
  put('planner_counts', Object.entries(p.counts || {}).map(([a, n]) => `${a} ${int(n)}`).join(', ') || 'none yet');
  put('planner_failed', int(p.failed));
  const rows = ds.slice(-PLANNER_ROWS).reverse(), body = $('#planner-table tbody');
  const key = JSON.stringify(rows.map((x) => [x.at, x.action, x.applied, x.reason]));
  if (body.dataset.key !== key) {
    body.dataset.key = key;
    body.replaceChildren(...(rows.length ? rows.map((x) => decisionRow(x, p.mode))
      : [h('tr', {class: 'hold'}, h('td', {colspan: 5}, `no decision yet (one every ${num(p.interval_s, F1, ' s')})`))]));
  }
  const t = [], pre = [], dec = [], at = (time, [a, b]) => { t.push(time); pre.push(a); dec.push(b); };
  for (const x of ds) {
    const cur = splitOf(x.current), next = splitOf(x.next);
    if (!isNum(x.time) || cur.length !== 2) continue;
    at(x.time, cur);
    if (x.applied && next.length === 2) at(x.time + 0.001, next); // the step
  }
  if (isNum(now)) at(now, [p.prefill, p.decode]);
  Plot.line($('#planner-chart'), {t, now, binS: 0, height: 170, fmt: (v) => num(v, F0), label: 'Workers per pool',
    series: [{name: 'prefill workers', values: pre, color: '#4a6f9c'},
      {name: 'decode workers', values: dec, color: '#7b2d8e', dash: '5 3'}]});
}

function decisionRow(x, mode) {
  const move = x.action !== 'hold', role = x.role ? ` ${x.role}` : '';
  const how = !move || x.applied ? '' : mode === 'act' ? ' (not applied)' : ' (advised)';
  return h('tr', {class: move ? `move ${x.action}` : 'hold', 'data-action': x.action},
    h('td', {}, isNum(x.time) ? TIME.format(x.time * 1000) : DASH), h('td', {}, `${x.action}${role}${how}`),
    h('td', {}, move ? `${x.current} → ${x.next}` : String(x.current)), h('td', {}, signed(x.gain)),
    h('td', {class: 'reason'}, String(x.reason || '')));
}

// == worker cards
// One card per worker id, built once and updated in place: cards = id -> {root, f: {field: el}, tiers}.
const box = $('#worker-cards'), cards = new Map(), TIERS = ['device', 'host', 'disk'];
const PARTS = ['used', 'free', 'reserved', 'total'];

function makeCard(w) {
  const f = {}, tiers = {};
  const fld = (tag, name, attrs) => (f[name] = h(tag, {'data-field': name, ...attrs}, DASH));
  const stat = (label, name) => h('div', {}, h('dt', {}, label), fld('dd', name));
  const kv = h('div', {class: 'kv'}, h('h4', {}, 'KV blocks'));
  for (const tier of TIERS) {
    const used = h('span', {class: 'used'}), res = h('span', {class: 'res'});
    const meter = h('span', {class: 'meter', 'aria-hidden': 'true'}, used, res);
    const nums = h('span', {class: 'tier-nums'},
      ...PARTS.filter((p) => tier === 'device' || p !== 'reserved').map((p) => h('span', {}, `${p} `, fld('b', `kv_${tier}_${p}`))));
    const row = h('div', {class: 'tier', 'data-tier': tier}, h('span', {class: 'tier-name'}, tier), meter,
      h('span', {class: 'tier-none'}, 'none'), nums);
    tiers[tier] = {row, used, res, meter};
    kv.append(row);
  }
  f.role = h('p', {class: 'role'});
  const root = h('article', {class: 'card', 'data-worker': w.id},
    h('h3', {}, h('span', {}, w.id), ' ', fld('span', 'alive', {class: 'health'})), f.role,
    h('dl', {class: 'stats'}, stat('restarts', 'restarts'), stat('tensor parallel', 'tp'), stat('queue depth', 'queue_depth'),
      stat('running batch', 'running'), stat('steps', 'steps'), stat('steps/s', 'steps_per_s'),
      stat('KV transfer', 'transfer_bytes_per_s'), stat('speculation', 'speculation'), stat('LoRA slots', 'lora')),
    h('p', {class: 'prompt'}, 'prompt tokens: ', fld('b', 'prompt_tokens_computed'), ' computed, ',
      fld('b', 'prompt_tokens_cached'), ' cached'),
    kv);
  return {root, f, tiers};
}

function renderWorkers(workers) {
  const seen = new Set();
  let prev = null;
  for (const w of workers) {
    if (!w || typeof w.id !== 'string') continue;
    seen.add(w.id);
    let card = cards.get(w.id);
    if (!card) cards.set(w.id, (card = makeCard(w)));
    const at = prev ? prev.nextSibling : box.firstChild; // keep the server's order, move only if needed
    if (at !== card.root) box.insertBefore(card.root, at);
    prev = card.root;
    updateCard(card, w);
  }
  for (const [id, card] of cards) if (!seen.has(id)) { card.root.remove(); cards.delete(id); }
  $('#workers-empty').hidden = cards.size > 0;
}

function updateCard({root, f, tiers}, w) {
  const role = w.role || '';
  if (root.dataset.role !== role) root.dataset.role = role;
  const state = w.state && w.state !== 'ready' ? w.state : ''; // standby, warming, promoting
  setText(f.role, state ? `${role || DASH} · ${state}` : (role || DASH));
  root.classList.toggle('standby', state === 'standby' || state === 'warming');
  setText(f.alive, w.alive ? 'alive' : 'down');
  root.classList.toggle('down', !w.alive);
  for (const k of ['restarts', 'queue_depth', 'running', 'steps', 'prompt_tokens_computed', 'prompt_tokens_cached']) setText(f[k], int(w[k]));
  const ranks = Array.isArray(w.kv_rank_bytes) ? w.kv_rank_bytes : [];
  setText(f.tp, int(w.tp) > 1 ? `${int(w.tp)} ranks${ranks.length > 1 ? ` (KV in by rank: ${ranks.map(bytes).join(' / ')})` : ''}` : '1 rank');
  setText(f.steps_per_s, num(w.steps_per_s, F1));
  setText(f.transfer_bytes_per_s, bytesPerS(w.transfer_bytes_per_s));
  const lo = w.lora;
  setText(f.lora, lo ? `${num(100 * lo.hit_rate, F1)}% hits, ${int(lo.evictions)} evicted` : 'none');
  if (lo) f.lora.title = `${int(lo.page_ins)} page-ins, ${int(lo.disk_loads)} folder reads, ${int(lo.evictions)} evictions`;
  const sp = w.speculation;
  setText(f.speculation, sp ? `${num(100 * sp.acceptance, F1)}% accepted, ${num(sp.tokens_per_step, F1)} tok/verify` : 'off');
  for (const tier of TIERS) {
    const t = (w.kv || {})[tier], el = tiers[tier], absent = !t || typeof t !== 'object';
    el.row.classList.toggle('absent', absent);
    for (const p of PARTS) if (f[`kv_${tier}_${p}`]) setText(f[`kv_${tier}_${p}`], absent ? 'none' : int(t[p]));
    if (absent) continue;
    const used = t.used || 0, resv = t.reserved || 0, total = t.total > 0 ? t.total : used + resv + (t.free || 0);
    const u = total ? Math.min(100, (100 * used) / total) : 0, r = total ? Math.min(100 - u, (100 * resv) / total) : 0;
    el.used.style.width = `${u.toFixed(1)}%`;
    el.res.style.width = `${r.toFixed(1)}%`;
    el.meter.title = `${F1.format(u)}% used${r ? `, ${F1.format(r)}% reserved` : ''}`;
  }
}

// == sizing form
const form = $('#sizing-form'), el = form.elements, errorBox = $('#sizing-error');
let options = null, optionsBusy = false;

// setError(msg, kind): the message beside the form; `kind` says what may clear it later.
function setError(msg, kind) {
  setText(errorBox, msg || '');
  errorBox.dataset.kind = (msg && kind) || '';
}

async function loadOptions() {
  if (options || optionsBusy) return;
  optionsBusy = true;
  try {
    options = await api('/dashboard/api/sizing/options');
    fillForm(options);
    if (errorBox.dataset.kind === 'options') setError('');
  } catch (e) {
    if (e.auth) return;
    setError(`cannot load the sizing options: ${e.message}; retrying`, 'options');
    setTimeout(() => view === 'sizing' && loadOptions(), 3000);
  } finally {
    optionsBusy = false;
  }
}

function fillForm(o) {
  const d = o.defaults || {};
  const opts = (items) => (items || []).map((it) => h('option', {value: it.name}, it.label || it.name));
  el.trace.replaceChildren(...opts(o.traces), h('option', {value: 'upload'}, 'upload a file'));
  el.profile.replaceChildren(...opts(o.profiles));
  for (const k in d) {
    const f = el.namedItem(k);
    if (f && f.type !== 'file' && d[k] != null) f.value = [].concat(d[k]).join(', ');
  }
  traceChanged();
  $('#sizing-fields').disabled = false;
}
function traceChanged() {
  $('#trace-file-field').hidden = el.trace.value !== 'upload';
  $('#live-minutes-field').hidden = el.trace.value !== 'live';
}
el.trace.addEventListener('change', traceChanged);

// formBody(): the POST body; throws Error("<field>: why") for what the browser can tell itself.
async function formBody() {
  const bad = (name, why) => { el[name].setAttribute('aria-invalid', 'true'); return new Error(`${name}: ${why}`); };
  const number = (name) => {
    const s = el[name].value.trim();
    if (!s || !isFinite(s)) throw bad(name, 'enter a number');
    return +s;
  };
  const list = (name) => el[name].value.split(/[\s,]+/).filter(Boolean).map((s) => {
    if (!/^\d+$/.test(s)) throw bad(name, `"${s}" is not a whole number of tokens`);
    return +s;
  });
  const body = {trace: el.trace.value, profile: el.profile.value, workers: number('workers'),
    device_tokens: list('device_tokens'), host_tokens: list('host_tokens'),
    ttft_ms: number('ttft_ms'), tbt_ms: number('tbt_ms'), speed: number('speed')};
  body.live_minutes = body.trace === 'live' ? number('live_minutes') : +el.live_minutes.value || undefined;
  if (body.trace === 'upload') {
    const file = el.trace_file.files[0], max = options && options.max_upload_bytes;
    if (!file) throw bad('trace_file', 'choose a trace file to upload');
    if (file.size > max) throw bad('trace_file', `the file has ${int(file.size)} bytes, the limit is ${int(max)}`);
    body.trace_text = await file.text();
  }
  return body;
}

form.addEventListener('submit', async (ev) => {
  ev.preventDefault();
  setError('');
  for (const e of form.querySelectorAll('[aria-invalid]')) e.removeAttribute('aria-invalid');
  try {
    const job = await api('/dashboard/api/sizing/jobs', {method: 'POST',
      headers: {'Content-Type': 'application/json'}, body: JSON.stringify(await formBody())});
    jobGen++;
    $('#sweep-results').hidden = true;
    renderJob(job, jobGen);
  } catch (e) {
    if (e.auth) return;
    if (e.param && el[e.param]) el[e.param].setAttribute('aria-invalid', 'true');
    setError(e.message, e.status === 409 ? 'busy' : '');
  }
});

// == a sweep job
let jobGen = 0; // the job shown; polls of an older one stop
async function pollJob(id, gen) {
  try {
    const job = await api(`/dashboard/api/sizing/jobs/${encodeURIComponent(id)}`);
    if (gen === jobGen) { hideBanner(); renderJob(job, gen); }
  } catch (e) {
    if (gen !== jobGen || e.auth) return;
    if (e.status === 404) { setText($('#sweep-state'), 'lost'); setError(`sweep ${id} is gone (did the server restart?)`); return; }
    showBanner(e.message);
    setTimeout(pollJob, 1000, id, gen);
  }
}
function renderJob(job, gen) {
  const total = isNum(job.total) ? job.total : 0, done = isNum(job.done) ? job.done : 0;
  const state = ['done', 'failed'].includes(job.state) ? job.state : 'running';
  $('#sweep-status').hidden = false;
  setText($('#sweep-id'), job.id || '');
  setText($('#sweep-state'), state);
  const bar = $('#sweep-progress');
  bar.max = Math.max(1, total);
  bar.value = done;
  setText($('#sweep-progress-text'), `${done} / ${total} shapes`);
  if (state === 'running') setTimeout(pollJob, 500, job.id, gen);
  else if (state === 'failed') setError(job.error || 'the sweep failed');
  else {
    if (errorBox.dataset.kind === 'busy') setError(''); // "a sweep is already running": not any more
    renderResult(job);
  }
}

const sameShape = (a, b) => !!b && ['prefill', 'decode', 'device_tokens', 'host_tokens'].every((k) => a[k] === b[k]);
function renderResult(job) {
  const rows = Array.isArray(job.rows) ? job.rows : [], best = rows.findIndex((r) => sameShape(r, job.best)), b = rows[best];
  $('#sweep-results').hidden = false;
  setText($('#recommendation'), b
    ? `Recommended: ${int(b.prefill)} prefill : ${int(b.decode)} decode, ${int(b.device_tokens)} device tokens, ` +
      `${int(b.host_tokens)} host tokens per worker — ${small(b.goodput_per_worker)} req/s goodput per worker`
    : 'No recommendation: the sweep found no shape to recommend.');
  Plot.bars($('#sweep-chart'), {values: rows.map((r) => r.goodput_per_worker), best, fmt: small,
    labels: rows.map((r) => [`${r.prefill}:${r.decode}`, `${kTokens(r.device_tokens)}/${kTokens(r.host_tokens)}`]),
    label: 'Goodput per worker by shape', names: {bar: 'goodput per worker (req/s)', best: 'recommended'}});
  $('#sweep-table tbody').replaceChildren(...rows.map((r, i) => {
    const rej = Object.entries(r.rejected || {});
    const cells = [int(r.device_tokens), int(r.host_tokens), num(r.goodput_rps, F3), num(r.goodput_per_worker, F4),
      num(r.admitted_ok_pct, F1, '%'), ms((r.ttft_ms || {}).p90), ms((r.tbt_ms || {}).p90)];
    return h('tr', {class: i === best ? 'best' : null},
      h('th', {scope: 'row'}, `${r.prefill}:${r.decode}`, ...(i === best ? [' ', h('span', {class: 'badge'}, 'recommended')] : [])),
      ...cells.map((c) => h('td', {}, c)),
      h('td', {title: rej.map(([k, n]) => `${k}: ${n}`).join(', ') || null}, int(rej.reduce((a, [, n]) => a + (+n || 0), 0))));
  }));
  setText($('#helm-values'), job.helm_values || DASH);
  $('#download-values').href = `/dashboard/api/sizing/jobs/${encodeURIComponent(job.id)}/values.yaml`;
  setText($('#copy-status'), '');
}

// Copy the Helm values with the Clipboard API, or (none, or refused) select them for Ctrl+C.
let copyTimer = null;
$('#copy-values').addEventListener('click', async () => {
  const pre = $('#helm-values');
  const copied = await (navigator.clipboard ? navigator.clipboard.writeText(pre.textContent).then(() => 1, () => 0) : 0);
  if (!copied) getSelection().selectAllChildren(pre);
  setText($('#copy-status'), copied ? 'copied' : 'selected: press Ctrl+C to copy');
  clearTimeout(copyTimer);
  copyTimer = setTimeout(setText, 4000, $('#copy-status'), '');
});

route();
})();
