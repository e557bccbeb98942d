// evalflow view: the browser side of `evalflow view` (docs/view.md).
// One file, no framework: a path router over history.pushState, one render function per
// view, DOM built with h() (text is always set as text, never parsed as HTML).
'use strict';
(() => {
// ---------------------------------------------------------------- DOM helpers
const SVGNS = 'http://www.w3.org/2000/svg';

/** Appends children (strings, numbers, nodes, arrays; null/false skipped). */
function add(el, kids) {
  for (const k of kids) {
    if (k == null || k === false) continue;
    if (Array.isArray(k)) add(el, k);
    else el.append(k instanceof Node ? k : document.createTextNode(String(k)));
  }
  return el;
}

/** Sets attributes: `on*` functions become listeners, `style` an object (CSP-safe), null/false skipped. */
function attrs(el, a) {
  for (const [k, v] of Object.entries(a || {})) {
    if (v == null || v === false) continue;
    if (k.startsWith('on') && typeof v === 'function') el.addEventListener(k.slice(2), v);
    else if (k === 'style') Object.assign(el.style, v);
    else if (k === 'value') el.value = v;
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  return el;
}

const h = (tag, a, ...kids) => add(attrs(document.createElement(tag), a), kids);
const svg = (tag, a, ...kids) => add(attrs(document.createElementNS(SVGNS, tag), a), kids);
const $ = (sel, root = document) => root.querySelector(sel);
const link = (href, ...kids) => h('a', { href }, ...kids);
const muted = (...kids) => h('span', { class: 'muted' }, ...kids);
const empty = (...kids) => h('p', { class: 'empty' }, ...kids);
const td = (...kids) => h('td', null, ...kids);
const tdn = (...kids) => h('td', { class: 'n' }, ...kids);
const enc = encodeURIComponent;

/** A query string from an object, skipping empty values ("" / null). */
function qs(params) {
  const p = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v != null && v !== '') p.set(k, v);
  const s = p.toString();
  return s ? '?' + s : '';
}

const runPath = (id) => '/runs/' + enc(id);
const answerPath = (id, call) => runPath(id) + '/answers/' + enc(call);

// ---------------------------------------------------------------- formatting
const isNum = (x) => typeof x === 'number' && Number.isFinite(x);
const pct = (x) => (isNum(x) ? (x * 100).toFixed(1) + '%' : '–');
const dec = (x, d) => (isNum(x) ? x.toFixed(d) : '–');
const int = (x) => (isNum(x) ? x.toLocaleString('en-US') : '–');

/** A generic number: integers as they are, others with at most 4 decimals. */
function num(x) {
  if (!isNum(x)) return '–';
  if (Number.isInteger(x)) return String(x);
  if (Math.abs(x) < 1e-4) return x.toExponential(1);
  return String(parseFloat(x.toFixed(4)));
}

/** Any JSON value as short text. */
function cellText(v) {
  if (v == null) return '';
  if (typeof v === 'number') return num(v);
  if (typeof v === 'object') return JSON.stringify(v);
  return String(v);
}

const isRate = (metric) => metric !== 'mean_score';

/** "12.0% [8.0%, 17.0%]" for rates, "0.492 [0.41, 0.57]" for means (bounds to 2 decimals). */
function metricText(metric, value, lo, hi) {
  const f = (x, d) => (isRate(metric) ? pct(x) : dec(x, d));
  return isNum(lo) && isNum(hi) ? `${f(value, 3)} [${f(lo, 2)}, ${f(hi, 2)}]` : f(value, 3);
}

const when = (iso) => (iso ? String(iso).replace('T', ' ').replace(/:\d\d(\.\d+)?Z$/, ' UTC') : '–');
const list = (xs) => (Array.isArray(xs) && xs.length ? xs.join(', ') : '–');
const cmpVersion = (a, b) => String(a).localeCompare(String(b), 'en', { numeric: true });

// ---------------------------------------------------------------- validity colours
const VERDICTS = ['valid_answer', 'empty_due_to_budget', 'empty_unexplained', 'truncated',
  'provider_error', 'unscorable_language', 'judge_unparseable', 'judge_error'];
const COLOURS = {
  valid_answer: '#2e8b57', empty_due_to_budget: '#e69138', empty_unexplained: '#f5b041',
  truncated: '#c0661b', provider_error: '#c0392b', unscorable_language: '#95a5a6',
  judge_unparseable: '#9b59b6', judge_error: '#6c3483', other_verdicts: '#5d6d7e',
};
const colour = (v) => COLOURS[v] || COLOURS.other_verdicts;

/** [verdict, count] pairs of a counts object, known verdicts first, zeros dropped. */
function verdictParts(counts) {
  const keys = Object.keys(counts || {});
  const order = VERDICTS.filter((v) => keys.includes(v)).concat(keys.filter((k) => !VERDICTS.includes(k)).sort());
  return order.map((v) => [v, counts[v]]).filter(([, n]) => isNum(n) && n > 0);
}

/** A stacked horizontal bar, one segment per verdict, with the counts as tooltip. */
function validityBar(counts, w = 140, ht = 12) {
  const parts = verdictParts(counts);
  const total = parts.reduce((s, [, n]) => s + n, 0);
  const tip = total ? parts.map(([v, n]) => `${v} ${int(n)} (${pct(n / total)})`).join('\n') : 'no rows';
  const g = svg('svg', { width: w, height: ht, viewBox: `0 0 ${w} ${ht}`, class: 'vbar', role: 'img', 'aria-label': tip });
  add(g, [svg('title', null, tip)]);
  if (!total) add(g, [svg('rect', { width: w, height: ht, class: 'vbar-empty' })]);
  let x = 0;
  for (const [v, n] of parts) {
    const dw = (n / total) * w;
    add(g, [svg('rect', { x: x.toFixed(2), width: Math.max(dw, 0.5).toFixed(2), height: ht, fill: colour(v) })]);
    x += dw;
  }
  return h('span', { class: 'vbar-wrap', title: tip, 'data-total': total }, g);
}

function legend(verdicts) {
  return h('div', { class: 'legend' }, verdicts.map((v) =>
    h('span', null, h('i', { style: { background: colour(v) } }), v)));
}

const verdictTag = (v) => h('span', { class: 'verdict' }, h('i', { style: { background: colour(v) } }), v ?? '–');

/** passed true/false/null as a coloured word. */
function passedTag(p) {
  if (p === true) return h('span', { class: 'pass' }, 'pass');
  if (p === false) return h('span', { class: 'fail' }, 'fail');
  return muted('null');
}

// ---------------------------------------------------------------- API
const TOKEN_KEY = 'evalflow_token';
let memToken = null;
function token() {
  try { return sessionStorage.getItem(TOKEN_KEY) || memToken; } catch { return memToken; }
}

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}
const isAbort = (e) => e && e.name === 'AbortError';

/** fetch + JSON; a non-2xx answer or a network failure throws an ApiError. */
async function api(path, { signal, method = 'GET', body } = {}) {
  const headers = { Accept: 'application/json' };
  const t = token();
  if (t) headers.Authorization = 'Bearer ' + t;
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  let res, text;
  try {
    res = await fetch(path, { method, headers, signal, credentials: 'same-origin',
      body: body === undefined ? undefined : JSON.stringify(body) });
    text = await res.text();
  } catch (e) {
    if (isAbort(e)) throw e;
    throw new ApiError(0, `network error on ${path}: ${e.message}`);
  }
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch {
    if (res.ok) throw new ApiError(res.status, `${path} did not answer JSON`);
  }
  if (!res.ok) throw new ApiError(res.status, (data && data.error) || res.statusText || 'request failed');
  return data;
}

// Run objects and scorer lists are reused between views of the same run for a few seconds.
const cache = new Map();
function cached(path, ttl = 10000, fresh = false) {
  const hit = cache.get(path);
  if (hit && !fresh && performance.now() - hit.t < ttl) return hit.p;
  const p = api(path);
  cache.set(path, { t: performance.now(), p });
  p.catch(() => cache.delete(path));
  return p;
}
const getRun = (id, fresh) => cached('/api/runs/' + enc(id), 10000, fresh);
const getScorers = (id) => cached('/api/runs/' + enc(id) + '/scorers', 30000);
const scorerKey = (s) => `${s.scorer}@${s.scoring_version}`;

// ---------------------------------------------------------------- shell
let main, crumbs, banner, rootLabel;

function shell() {
  banner = h('div', { id: 'error-banner', role: 'alert', hidden: true });
  crumbs = h('nav', { id: 'crumbs', 'aria-label': 'breadcrumbs' });
  rootLabel = h('span', { id: 'root', class: 'root' });
  main = h('main', { id: 'main' });
  document.body.replaceChildren(
    h('header', { id: 'topbar' },
      link('/', h('b', null, 'evalflow view')), rootLabel, crumbs,
      h('span', { class: 'spacer' }), link('/compare', 'compare runs')),
    banner, main);
  // The root is not in docs/view.md's API: shown when the server answers /api/info.
  api('/api/info').then((i) => { if (i && i.root) rootLabel.textContent = i.root; }).catch(() => {});
}

function showError(e) {
  banner.replaceChildren(
    h('b', null, e.status ? `HTTP ${e.status}` : 'Error'), ': ', e.message || String(e),
    h('button', { type: 'button', class: 'close', title: 'dismiss', onclick: hideError }, '×'));
  banner.hidden = false;
}
function hideError() { banner.hidden = true; banner.replaceChildren(); }

const setReady = (v) => { document.body.dataset.ready = v; };

// ---------------------------------------------------------------- router
const ROUTES = [
  [/^\/$/, viewRuns],
  [/^\/runs\/([^/]+)$/, viewRun],
  [/^\/runs\/([^/]+)\/answers$/, viewAnswers],
  [/^\/runs\/([^/]+)\/answers\/([^/]+)$/, viewAnswer],
  [/^\/runs\/([^/]+)\/scorers$/, viewScorers],
  [/^\/runs\/([^/]+)\/sql$/, viewSql],
  [/^\/compare$/, viewCompare],
];

let current = null; // the context of the view on screen

function navigate(url, { replace = false } = {}) {
  if (replace) history.replaceState(null, '', url);
  else if (url !== location.pathname + location.search) history.pushState(null, '', url);
  render();
}

const dec1 = (s) => { try { return decodeURIComponent(s); } catch { return s; } };

/** Renders the view of the current URL; the previous view's fetches and timers stop. */
async function render() {
  const act = document.activeElement; // a focused filter keeps its focus across the re-render
  const focusId = act && /^(INPUT|SELECT|TEXTAREA)$/.test(act.tagName) ? act.id : null;
  if (current) current.stop();
  const ctrl = new AbortController();
  const timers = new Set();
  const ctx = {
    signal: ctrl.signal,
    params: new URLSearchParams(location.search),
    alive: () => current === ctx,
    stop() { ctrl.abort(); timers.forEach(clearTimeout); },
    later(fn, ms) { const t = setTimeout(() => { timers.delete(t); if (ctx.alive()) fn(); }, ms); timers.add(t); },
    get: (path) => api(path, { signal: ctrl.signal }),
    focus() {
      const el = focusId && document.getElementById(focusId);
      if (el && el !== document.activeElement) {
        el.focus({ preventScroll: true });
        if (el.setSelectionRange && (el.type === 'text' || el.type === 'search')) el.setSelectionRange(el.value.length, el.value.length);
      }
    },
  };
  current = ctx;
  setReady('0');
  hideError();
  const box = h('div', { class: 'view' }, h('p', { class: 'muted loading' }, 'loading…'));
  main.replaceChildren(box);
  const path = location.pathname.replace(/(.)\/+$/, '$1');
  let route = null, args = [];
  for (const [re, fn] of ROUTES) {
    const m = re.exec(path);
    if (m) { route = fn; args = m.slice(1).map(dec1); break; }
  }
  try {
    if (!route) {
      setCrumbs([['not found']]);
      throw new ApiError(404, `no page at ${path}`);
    }
    await route(ctx, box, ...args);
    if (ctx.alive()) ctx.focus();
  } catch (e) {
    if (!ctx.alive() || isAbort(e)) return;
    showError(e);
    if (box.querySelector('.loading')) {
      box.replaceChildren(h('p', { class: 'failed' }, 'This view could not be loaded. ', link('/', 'All runs')));
    }
  } finally {
    if (ctx.alive()) setReady('1');
  }
}

/** Breadcrumbs: [[label, href?], ...] after the root link; the last is the page. */
function setCrumbs(items) {
  crumbs.replaceChildren(...items.map(([label, href]) =>
    h('span', null, href ? link(href, label) : h('span', { class: 'here' }, label))));
  const last = items.length ? items[items.length - 1][0] : 'runs';
  document.title = 'evalflow view · ' + last;
}
const runCrumbs = (id, ...more) => setCrumbs([[id, more.length ? runPath(id) : null], ...more]);

// Same-origin links navigate in place; middle-click and modifier keys keep the browser's way.
document.addEventListener('click', (e) => {
  if (e.defaultPrevented || e.button !== 0 || e.metaKey || e.ctrlKey || e.shiftKey || e.altKey) return;
  const a = e.target.closest && e.target.closest('a[href]');
  if (!a || (a.target && a.target !== '_self') || a.hasAttribute('download')) return;
  const u = new URL(a.href, location.href);
  if (u.origin !== location.origin || /^\/(api|assets)\//.test(u.pathname)) return;
  e.preventDefault();
  navigate(u.pathname + u.search);
  window.scrollTo(0, 0);
});
window.addEventListener('popstate', render);

// ---------------------------------------------------------------- small widgets
/** A <select> whose options are [value, label] pairs or plain values; "" means any. */
function select(id, name, value, options, { any = 'any', onchange } = {}) {
  const opts = options.map((o) => (Array.isArray(o) ? o : [String(o), String(o)]));
  if (value && !opts.some(([v]) => v === value)) opts.push([value, value]);
  return h('select', { id, name, onchange },
    any != null ? h('option', { value: '' }, any) : null,
    opts.map(([v, l]) => h('option', { value: v, selected: v === (value || '') }, l)));
}

const field = (label, control) => h('label', { class: 'field' }, h('span', null, label), control);
const section = (title, ...kids) => h('section', null, h('h2', null, title), ...kids);

/** A <dl> of [label, value] pairs, skipping null values. */
function facts(pairs, cls = 'facts') {
  const dl = h('dl', { class: cls });
  for (const [k, v] of pairs) if (v != null && v !== '') add(dl, [h('dt', null, k), h('dd', null, v)]);
  return dl;
}

/** A text snippet cell: one line, the whole text in the tooltip. */
const snip = (text, cls = 'snip') => h('td', { class: cls, title: text ?? '' }, text ?? '');

/** A table from column names and row arrays of cells (nodes or values). */
function table(attrsObj, cols, rows) {
  return h('table', attrsObj,
    h('thead', null, h('tr', null, cols.map((c) => (c instanceof Element && c.tagName === 'TH' ? c : h('th', null, c))))),
    h('tbody', null, rows));
}

// ---------------------------------------------------------------- view: runs index
async function viewRuns(ctx, box) {
  setCrumbs([['runs']]);
  let runs = await ctx.get('/api/runs');
  const wrap = h('div');
  const form = compareForm(runs);
  const draw = () => {
    wrap.replaceChildren(runsTable(runs));
    const running = runs.filter((r) => r.status === 'running').length;
    if (running) add(wrap, [h('p', { class: 'muted' }, `${running} run(s) being written: refreshing every 2 s.`)]);
  };
  draw();
  box.replaceChildren(h('h1', null, 'Runs'), wrap, legend(VERDICTS), form);
  // While a run is being written, poll so its rows grow on screen.
  const poll = async () => {
    try {
      runs = await ctx.get('/api/runs');
      if (!ctx.alive()) return;
      hideError();
      draw();
    } catch (e) {
      if (isAbort(e) || !ctx.alive()) return;
      showError(e);
    }
    if (runs.some((r) => r.status === 'running' || r.headline_pending)) ctx.later(poll, 2000);
  };
  if (runs.some((r) => r.status === 'running' || r.headline_pending)) ctx.later(poll, 2000);
}

function runsTable(runs) {
  if (!runs.length) return empty('No runs under this root.');
  const rows = runs.map((r) => {
    const id = h('td', { class: 'id' }, link(runPath(r.run_id), r.run_id));
    const status = td(h('span', { class: 'status s-' + r.status }, r.status));
    if (r.status === 'error') {
      return h('tr', { 'data-run-id': r.run_id, 'data-status': r.status, class: 'err' }, id,
        h('td', { colspan: 5, class: 'error-text' }, r.error || 'unreadable'), status, h('td', { colspan: 2 }, r.path || ''));
    }
    const hl = r.headline;
    return h('tr', { 'data-run-id': r.run_id, 'data-status': r.status, 'data-answers': r.answers ?? '' }, id,
      h('td', { class: 'nowrap', title: r.created || '' }, when(r.created).replace(' UTC', '')),
      td(r.pipeline || '–'),
      td(list(r.models)),
      td(list(r.scorers)),
      tdn(int(r.answers)),
      status,
      td(validityBar(r.validity, 120)),
      td(hl ? [
        h('span', { class: 'metric nowrap', title: `${hl.scorer}@${hl.scoring_version}, n = ${hl.n}` },
          metricText(hl.metric, hl.value, hl.ci_lo, hl.ci_hi)),
        h('div', { class: 'muted' }, `${hl.metric.replace('_', ' ')} · ${hl.scorer}@${hl.scoring_version}`)] : muted('–')));
  });
  return table({ id: 'runs-table', class: 'grid' },
    ['run', 'created', 'pipeline', 'models', 'scorers', 'answers', 'status', 'validity', 'headline (95% CI)'], rows);
}

/** Two run selects and a button that open /compare?a=&b=. */
function compareForm(runs, a, b) {
  const given = a;
  const ids = runs.filter((r) => r.status !== 'error').map((r) => r.run_id);
  b = b || ids[0];
  a = a || ids.find((x) => x !== b) || ids[0];
  const form = h('form', { class: 'bar', action: '/compare', method: 'get', id: 'compare-form' },
    given !== undefined ? null : h('b', null, 'Compare two runs'),
    field('A (baseline)', select('compare-a', 'a', a, ids, { any: null })),
    field('B (candidate)', select('compare-b', 'b', b, ids, { any: null })),
    h('button', { type: 'submit' }, 'Compare'));
  form.addEventListener('submit', (e) => {
    e.preventDefault();
    navigate('/compare' + qs({ a: form.a.value, b: form.b.value }));
  });
  return form;
}

// ---------------------------------------------------------------- view: one run
async function viewRun(ctx, box, id) {
  runCrumbs(id);
  const run = await getRun(id, true);
  const head = runHeader(run);
  if (run.status === 'error') {
    box.replaceChildren(head);
    return;
  }
  const [results, scorers] = await Promise.all([ctx.get(`/api/runs/${enc(id)}/results`), getScorers(id)]);
  const links = h('p', { class: 'links' },
    link(runPath(id) + '/answers', 'Answers'),
    scorers.length >= 2 ? link(runPath(id) + '/scorers', 'Scorer versions diff') : null,
    link(runPath(id) + '/sql', 'SQL'),
    link('/compare' + qs({ b: id }), 'Compare with another run'));
  box.replaceChildren(head, links, forest(ctx, id, run, results || []));
}

function runHeader(run) {
  const t = run.tokens || {};
  const stages = run.stages ? Object.entries(run.stages).map(([k, s]) =>
    h('span', { class: 'stage s-' + (s && s.status) }, `${k} `, h('small', null, `${s && s.status} · ${int(s && s.rows)}`))) : null;
  const hl = run.headline;
  return h('header', { class: 'run-head', 'data-run-id': run.run_id },
    h('h1', null, run.run_id, ' ', h('span', { class: 'status s-' + run.status }, run.status)),
    run.status === 'error' ? h('p', { class: 'error-text' }, run.error || 'the run could not be read') : null,
    facts([
      ['path', run.path], ['created', run.created && when(run.created)], ['pipeline', run.pipeline],
      ['models', list(run.models)], ['scorers', list(run.scorers)], ['answers', run.answers != null ? int(run.answers) : null],
      ['tokens', run.tokens && `prompt ${int(t.prompt)} · completion ${int(t.completion)} · reasoning ${int(t.reasoning)}`],
      ['stages', stages],
      ['headline', hl && `${hl.metric.replace('_', ' ')} ${metricText(hl.metric, hl.value, hl.ci_lo, hl.ci_hi)} (${hl.scorer}@${hl.scoring_version}, n = ${int(hl.n)})`],
      ['validity', run.validity && h('span', null, validityBar(run.validity, 420, 14))],
    ]));
}

const FOREST_W = 260, FOREST_H = 18, PAD = 16;

/** Round tick values for an axis over [lo, hi]. */
function ticks(lo, hi) {
  const raw = (hi - lo) / 4;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => (hi - lo) / s <= 5) || raw;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
  return out;
}

/** The forest plot: a section per level, a row per results row, for one scorer version. */
function forest(ctx, id, run, results) {
  const out = h('div', { id: 'forest' });
  if (!results.length) return add(out, [empty('No results yet: the run has not been aggregated.')]);
  const keys = [...new Set(results.map(scorerKey))].sort(cmpVersion);
  // ?scorer= if given, else the headline's scorer version, else the newest of the first scorer.
  const first = keys.filter((k) => k.split('@')[0] === keys[0].split('@')[0]);
  const key = [ctx.params.get('scorer'), run.headline && scorerKey(run.headline)].find((k) => keys.includes(k)) || first[first.length - 1];
  const rows = results.filter((r) => scorerKey(r) === key);
  const metric = rows[0].metric;
  const scorerSel = keys.length > 1 ? field('scorer', select('forest-scorer', 'scorer', key, keys, {
    any: null, onchange: (e) => navigate(runPath(id) + qs({ scorer: e.target.value })),
  })) : muted('scorer ' + key);

  // The axis: [0, 1] for rates, the span of the rows for means.
  let lo = 0, hi = 1;
  if (!isRate(metric)) {
    const vals = rows.flatMap((r) => [r.ci_lo, r.value, r.ci_hi]).filter(isNum);
    if (vals.length) { lo = Math.min(...vals); hi = Math.max(...vals); }
    const pad = Math.max((hi - lo) * 0.05, 1e-3);
    lo -= pad; hi += pad;
  }
  const tk = ticks(lo, hi);
  const x = (v) => PAD + ((Math.min(Math.max(v, lo), hi) - lo) / (hi - lo)) * (FOREST_W - 2 * PAD);
  const axis = svg('svg', { width: FOREST_W, height: 16, class: 'axis' },
    tk.map((t) => svg('text', { x: x(t).toFixed(1), y: 12, 'text-anchor': 'middle' }, isRate(metric) ? Math.round(t * 100) + '%' : num(t))));

  const cell = (r) => {
    const g = svg('svg', { width: FOREST_W, height: FOREST_H, class: 'fp' + (r.clustered === false ? ' unclustered' : '') },
      tk.map((t) => svg('line', { x1: x(t), x2: x(t), y1: 0, y2: FOREST_H, class: 'grid' })));
    if (isNum(r.ci_lo) && isNum(r.ci_hi)) {
      add(g, [svg('line', { x1: x(r.ci_lo), x2: x(r.ci_hi), y1: FOREST_H / 2, y2: FOREST_H / 2, class: 'ci' })]);
    }
    if (isNum(r.value)) add(g, [svg('circle', { cx: x(r.value), cy: FOREST_H / 2, r: 3.5, class: 'pt' })]);
    return g;
  };

  const levels = [...new Set(rows.map((r) => r.level))]
    .sort((a, b) => (a === 'test' ? -1 : b === 'test' ? 1 : a.localeCompare(b)));
  add(out, [h('div', { class: 'bar' }, h('b', null, metricTitle(metric)), scorerSel,
    muted('Points with their 95% interval (clustered by template); * = not clustered. Each row links to its answers.'))]);

  for (const level of levels) {
    const lr = rows.filter((r) => r.level === level).sort((a, b) =>
      [a.capability, a.test_type, a.test || '', a.model, a.label || ''].join('\u0001')
        .localeCompare([b.capability, b.test_type, b.test || '', b.model, b.label || ''].join('\u0001')));
    const body = [];
    let cap = null;
    for (const r of lr) {
      if (level === 'test' && r.capability !== cap) {
        cap = r.capability;
        body.push(h('tr', { class: 'grp' }, h('td', { colspan: 8 }, cap)));
      }
      const name = level === 'test' ? (r.test ?? '–') : `${r.capability} · ${r.test_type}`;
      const href = runPath(id) + '/answers' + qs(level === 'test'
        ? { test: r.test, model: r.model, scorer: key }
        : { capability: r.capability, test_type: r.test_type, model: r.model, scorer: key });
      const counts = {};
      for (const v of VERDICTS.concat('other_verdicts')) if (isNum(r[v])) counts[v] = r[v];
      const star = r.clustered === false ? h('span', { class: 'star', title: r.interval_note || 'interval not clustered' }, ' *') : null;
      body.push(h('tr', {
        'data-result-row': '', 'data-level': r.level, 'data-test': r.test ?? '', 'data-capability': r.capability,
        'data-test-type': r.test_type, 'data-model': r.model, 'data-label': r.label ?? '', 'data-n': r.n,
        'data-value': r.value ?? '', 'data-lo': r.ci_lo ?? '', 'data-hi': r.ci_hi ?? '',
        'data-clustered': String(r.clustered),
      },
      h('td', { class: 'name' }, link(href, name, r.label != null ? ' · ' + r.label : '')),
      td(level === 'test' ? r.test_type : ''),
      td(r.model),
      tdn(int(r.n)),
      h('td', { class: 'n nowrap', title: r.interval_note || r.ci_method || '' },
        metricText(metric, r.value, r.ci_lo, r.ci_hi), star),
      h('td', { class: 'fp-cell' }, link(href, cell(r))),
      h('td', { class: 'muted' }, r.ci_method || ''),
      td(validityBar(counts, 120, 11))));
    }
    add(out, [h('section', { class: 'forest-level', 'data-level': level },
      h('h2', null, level === 'test' ? 'Per test' : level === 'capability' ? 'Per capability × test type' : level),
      table({ class: 'grid forest' },
        [level === 'test' ? 'test' : 'capability · type', level === 'test' ? 'type' : '', 'model', 'n',
          metricTitle(metric).toLowerCase() + ' [95% CI]', axis.cloneNode(true), 'method', 'validity'], body))]);
  }
  add(out, [legend(VERDICTS)]);
  return out;
}

function metricTitle(metric) {
  return { failure_rate: 'Failure rate', label_rate: 'Rate of each label', mean_score: 'Mean score' }[metric] || metric;
}

// ---------------------------------------------------------------- view: answers
const ANSWER_FILTERS = [
  // [param, label, run object field]
  ['test', 'test', 'tests'], ['capability', 'capability', 'capabilities'], ['test_type', 'type', 'test_types'],
  ['model', 'model', 'models'], ['validity', 'validity', 'validities'], ['finish_reason', 'finish', 'finish_reasons'],
];
const ANSWER_PARAMS = ANSWER_FILTERS.map((f) => f[0]).concat('scorer', 'passed', 'score_min', 'score_max', 'q');

async function viewAnswers(ctx, box, id) {
  runCrumbs(id, ['answers']);
  const [run, scorers] = await Promise.all([getRun(id), getScorers(id)]);
  const p = ctx.params;
  const filters = {};
  for (const k of ANSWER_PARAMS) if (p.get(k)) filters[k] = p.get(k);

  // Filter bar: any change navigates to the new URL, from the first page.
  const form = h('form', { id: 'answer-filters', class: 'bar filters' });
  const go = () => {
    const f = {};
    for (const k of ANSWER_PARAMS) if (form.elements[k] && form.elements[k].value.trim()) f[k] = form.elements[k].value.trim();
    navigate(runPath(id) + '/answers' + qs(f));
  };
  add(form, [field('search', h('input', { id: 'f-q', name: 'q', type: 'search', size: 26, placeholder: 'input or response contains…', value: filters.q || '' })),
    h('button', { type: 'submit' }, 'Search')]);
  for (const [k, label, src] of ANSWER_FILTERS) {
    add(form, [field(label, select('f-' + k, k, filters[k], run[src] || [], { onchange: go }))]);
  }
  add(form, [
    field('scorer', select('f-scorer', 'scorer', filters.scorer, scorers.map(scorerKey), { any: 'primary', onchange: go })),
    field('passed', select('f-passed', 'passed', filters.passed, ['true', 'false', 'null'], { onchange: go })),
    field('score ≥', h('input', { id: 'f-score_min', name: 'score_min', type: 'text', inputmode: 'decimal', size: 4, value: filters.score_min || '', onchange: go })),
    field('score ≤', h('input', { id: 'f-score_max', name: 'score_max', type: 'text', inputmode: 'decimal', size: 4, value: filters.score_max || '', onchange: go })),
    Object.keys(filters).length ? link(runPath(id) + '/answers', 'clear') : null,
  ]);
  form.addEventListener('submit', (e) => { e.preventDefault(); go(); });

  const status = h('div', { id: 'answers-status', class: 'status-line' });
  const result = h('div', { id: 'answers-result' });
  box.replaceChildren(h('h1', null, 'Answers'), form, status, result);
  ctx.focus();

  // The page fetch, abortable by Cancel and by any new navigation.
  const after = p.get('after');
  const apiPath = `/api/runs/${enc(id)}/answers` + qs({ ...filters, after });
  const ac = new AbortController();
  ctx.signal.addEventListener('abort', () => ac.abort());
  status.replaceChildren(h('span', { class: 'spinner' }), filters.q ? 'searching…' : 'loading…', ' ',
    h('button', { type: 'button', id: 'cancel-search', onclick: () => ac.abort() }, 'Cancel'));
  const t0 = performance.now();
  let page;
  try {
    page = await api(apiPath, { signal: ac.signal });
  } catch (e) {
    if (isAbort(e) && ctx.alive()) {
      status.replaceChildren(muted('cancelled. '), h('button', { type: 'button', onclick: () => render() }, 'Retry'));
      return;
    }
    status.replaceChildren();
    throw e;
  }
  const ms = performance.now() - t0;
  const here = (extra) => runPath(id) + '/answers' + qs({ ...filters, ...extra });
  const pager = (withId) => h('span', { class: 'pager' },
    after ? link(here({}), '⇤ First page') : null,
    page.next ? h('a', { href: here({ after: page.next }), id: withId ? 'next-page' : null, class: 'next-page' }, 'Next page →')
      : muted('last page'));
  status.replaceChildren(
    h('span', { id: 'answers-count', 'data-rows': page.rows.length, 'data-ms': Math.round(ms) },
      `${page.rows.length} row${page.rows.length === 1 ? '' : 's'} on this page · ${Math.round(ms)} ms`),
    muted(` · scorer ${page.scorer || 'primary'}${after ? ' · after ' + after : ''}`), pager(true));
  if (!page.rows.length) {
    result.replaceChildren(empty('No answer matches these filters.'));
    return;
  }
  const rows = page.rows.map((r) => {
    const href = answerPath(id, r.call_id);
    return h('tr', { 'data-call-id': r.call_id, 'data-href': href, class: 'clickable' },
      td(r.test), td(r.model), tdn(r.sample_idx),
      h('td', { class: 'snip', title: r.input ?? '' }, link(href, r.input || '(empty)')),
      snip(r.response), snip(r.expected, 'snip short'),
      td(verdictTag(r.validity)), td(r.finish_reason ?? ''),
      tdn(r.score == null ? '' : num(r.score)), td(passedTag(r.passed)));
  });
  const tbl = table({ id: 'answers-table', class: 'grid answers' },
    ['test', 'model', 'k', 'input', 'response', 'expected', 'validity', 'finish', 'score', 'passed'], rows);
  rowLinks(tbl);
  result.replaceChildren(tbl, h('p', { class: 'bottom-pager' }, pager(false)));
}

/** Clicking anywhere on a row with data-href opens it (unless text is being selected). */
function rowLinks(tbl) {
  tbl.addEventListener('click', (e) => {
    const tr = e.target.closest('tr[data-href]');
    if (!tr || e.target.closest('a,button') || String(getSelection())) return;
    if (e.ctrlKey || e.metaKey) window.open(tr.dataset.href);
    else navigate(tr.dataset.href);
  });
}

// ---------------------------------------------------------------- view: one answer
async function viewAnswer(ctx, box, id, callId) {
  const d = await ctx.get(`/api/runs/${enc(id)}/answers/${enc(callId)}`);
  const call = d.call || {}, kase = d.case || {}, val = d.validity || {}, scores = d.scores || [];
  runCrumbs(id, ['answers', runPath(id) + '/answers'], [callId]);
  const back = runPath(id) + '/answers' + qs({ test: kase.test, model: call.model });

  const pre = (text, f, cls) => h('pre', { 'data-field': f, class: cls || 'text' }, text == null ? muted('(null)') : text);
  const head = h('header', null,
    h('h1', null, 'Answer ', h('code', null, callId)),
    h('p', { class: 'links' },
      h('span', null, [kase.capability, kase.test_type, kase.test].filter(Boolean).join(' · ')),
      h('span', null, 'role ' + (kase.role ?? '–')), h('span', null, 'model ' + (call.model ?? '–')),
      h('span', null, 'sample ' + (call.sample_idx ?? '–')), link(back, 'the answers of this test and model')));

  const expected = h('div', { 'data-field': 'expected' },
    h('pre', { class: 'text short' }, kase.expected == null ? '(none)' : kase.expected),
    facts([['expectation', kase.expectation], ['tolerance', kase.tolerance != null ? num(kase.tolerance) : null],
      ['perturbation', kase.perturbation], ['template', kase.template_id], ['case', kase.case_id]], 'facts small'));

  const verdict = h('div', { 'data-field': 'validity', 'data-validity': val.validity ?? '' },
    verdictTag(val.validity), ' ', h('span', null, val.validity_reason || ''),
    facts([['language', val.language], ['answer chars', val.answer_chars != null ? int(val.answer_chars) : null],
      ['validator', val.validator_version]], 'facts inline'));

  const out = [head,
    h('div', { class: 'cols two' }, section('Input', pre(kase.input, 'input')), section('Expected', expected)),
    section('Response', pre(call.response, 'response', 'text response')),
    section('Validity', verdict)];

  // The K samples of this case and model (this one included, scored by the primary
  // scorer), side by side; nothing to show when K = 1.
  if (d.samples && d.samples.length > 1) {
    const all = d.samples.map((s) => ({ ...s, self: s.call_id === callId }))
      .sort((a, b) => (a.sample_idx ?? 0) - (b.sample_idx ?? 0));
    out.push(section(`Samples (K = ${all.length})`, h('div', { class: 'samples', style: { gridTemplateColumns: `repeat(${Math.min(all.length, 4)},minmax(0,1fr))` } },
      all.map((s) => h('div', { class: 'sample' + (s.self ? ' self' : ''), 'data-sample-idx': s.sample_idx ?? '' },
        h('div', { class: 'sample-head' }, s.self ? h('b', null, `sample ${s.sample_idx} (this one)`) : link(answerPath(id, s.call_id), `sample ${s.sample_idx}`),
          ' ', passedTag(s.passed), s.score != null ? ` score ${num(s.score)}` : ''),
        h('div', { class: 'muted' }, verdictTag(s.validity), s.finish_reason ? ' · ' + s.finish_reason : ''),
        h('pre', { class: 'text' }, s.response ?? '(null)'))))));
  }

  // Every scorer version's verdict on this answer.
  out.push(section('Scores', scores.length ? table({ class: 'grid scores', id: 'scores-table' },
    ['scorer', 'score', 'passed', 'label', 'prob', 'validity', 'detail'],
    scores.map((s) => h('tr', { 'data-scorer': `${s.scorer}@${s.scoring_version}` },
      h('td', { class: 'nowrap' }, `${s.scorer}@${s.scoring_version}`), tdn(s.score == null ? '' : num(s.score)),
      td(passedTag(s.passed)), td(s.label ?? ''), tdn(s.prob == null ? '' : num(s.prob)),
      td(verdictTag(s.validity)), td(detail(s.detail)))))
    : empty('No scores for this answer.')));

  // For a perturbed case: its base case and the base answers, next to this one.
  if (d.base) {
    const b = d.base;
    out.push(section('Base case', h('div', { class: 'cols two base' },
      h('div', null, h('h3', null, 'Base input'),
        h('pre', { class: 'text', 'data-field': 'base-input' }, (b.case && b.case.input) ?? ''),
        h('p', { class: 'muted' }, 'expected ', (b.case && b.case.expected) ?? '–'),
        (b.answers || []).map((a) => h('div', { class: 'sample' },
          h('div', { class: 'sample-head' }, link(answerPath(id, a.call_id), `base sample ${a.sample_idx}`), ' ', passedTag(a.passed),
            a.score != null ? ` score ${num(a.score)}` : '', ' ', verdictTag(a.validity)),
          h('pre', { class: 'text' }, a.response ?? '(null)')))),
      h('div', null, h('h3', null, 'This perturbation', kase.perturbation ? `: ${kase.perturbation}` : ''),
        h('pre', { class: 'text' }, kase.input ?? ''),
        h('div', { class: 'sample self' }, h('div', { class: 'sample-head' }, 'this answer'), h('pre', { class: 'text' }, call.response ?? '(null)'))))));
  }

  // The call's facts, then every other column.
  const shown = ['prompt_tokens', 'completion_tokens', 'reasoning_tokens', 'latency_ms', 'attempts', 'http_status',
    'error', 'finish_reason', 'max_tokens', 'temperature', 'started_at', 'batch_id'];
  const rest = Object.keys(call).filter((k) => !shown.includes(k) && k !== 'response');
  out.push(section('Call', facts([
    ['tokens', `prompt ${int(call.prompt_tokens)} · completion ${int(call.completion_tokens)} · reasoning ${int(call.reasoning_tokens)}`],
    ['latency', call.latency_ms != null ? `${num(call.latency_ms)} ms` : null], ['attempts', call.attempts],
    ['HTTP status', call.http_status], ['error', call.error && h('span', { class: 'error-text' }, call.error)],
    ['finish_reason', call.finish_reason], ['max_tokens', call.max_tokens], ['temperature', call.temperature],
    ['started_at', call.started_at], ['batch_id', call.batch_id],
  ]), h('details', null, h('summary', null, 'all columns of the call and the case'),
    facts(rest.map((k) => ['call.' + k, cellText(call[k])]).concat(Object.keys(kase).map((k) => ['case.' + k, cellText(kase[k])])), 'facts small'))));

  box.replaceChildren(h('div', { id: 'answer-detail', 'data-call-id': callId }, out));
}

/** A scorer's detail: pretty JSON when it parses as an object or array, else text. */
function detail(s) {
  if (s == null || s === '') return '';
  try {
    const v = typeof s === 'string' ? JSON.parse(s) : s;
    if (v && typeof v === 'object') return h('pre', { class: 'json' }, JSON.stringify(v, null, 2));
  } catch { /* plain text */ }
  return h('span', { class: 'detail' }, String(s));
}

// ---------------------------------------------------------------- view: scorer diff
const CELL_ORDER = ['pass', 'fail', 'unscored'];
function cellOrder(a, b) {
  const ia = CELL_ORDER.indexOf(a), ib = CELL_ORDER.indexOf(b);
  if (ia >= 0 || ib >= 0) return (ia < 0 ? 9 : ia) - (ib < 0 ? 9 : ib);
  const na = parseFloat(a), nb = parseFloat(b);
  return Number.isFinite(na) && Number.isFinite(nb) ? na - nb : String(a).localeCompare(String(b));
}

async function viewScorers(ctx, box, id) {
  runCrumbs(id, ['scorer diff']);
  const keys = (await getScorers(id)).map(scorerKey);
  const p = ctx.params;
  let a = p.get('a'), b = p.get('b');
  if (keys.length < 2) {
    box.replaceChildren(h('h1', null, 'Scorer versions'), empty(`This run has ${keys.length} scorer version(s): nothing to compare.`));
    return;
  }
  if (!a || !b) { // default to the two first versions, in the URL too
    a = a || keys[0];
    b = b || keys.find((k) => k !== a);
    history.replaceState(null, '', runPath(id) + '/scorers' + qs({ a, b }));
  }
  const go = () => navigate(runPath(id) + '/scorers' + qs({ a: $('#diff-a').value, b: $('#diff-b').value }));
  const form = h('form', { class: 'bar' },
    field('A', select('diff-a', 'a', a, keys, { any: null, onchange: go })),
    field('B', select('diff-b', 'b', b, keys, { any: null, onchange: go })));
  box.replaceChildren(h('h1', null, 'Scorer versions: A vs B'), form, h('p', { class: 'muted loading' }, 'loading…'));

  const after = p.get('after');
  const d = await ctx.get(`/api/runs/${enc(id)}/scorer-diff` + qs({ a, b, after }));
  d.matrix = d.matrix || [];
  const vals = [...new Set(d.matrix.flatMap((c) => [String(c.a), String(c.b)]))].sort(cellOrder);
  const n = new Map(d.matrix.map((c) => [String(c.a) + '\u0001' + String(c.b), c.n]));
  const matrix = h('table', { id: 'diff-matrix', class: 'grid matrix' },
    h('thead', null, h('tr', null, h('th', null, `A ${d.a} ↓ · B ${d.b} →`), vals.map((v) => h('th', { class: 'n' }, v)))),
    h('tbody', null, vals.map((va) => h('tr', null, h('th', null, va), vals.map((vb) => {
      const k = n.get(va + '\u0001' + vb) || 0;
      return h('td', { class: 'n' + (va !== vb && k ? ' dis' : '') + (k ? '' : ' zero'), 'data-a': va, 'data-b': vb, 'data-n': k }, int(k));
    })))));
  const share = d.total ? ` (${pct(d.disagree / d.total)})` : '';
  const disagree = h('p', { id: 'diff-disagree', 'data-disagree': d.disagree, 'data-total': d.total },
    h('b', null, int(d.disagree)), ` of ${int(d.total)} answers disagree${share}.`);

  const here = (extra) => runPath(id) + '/scorers' + qs({ a, b, ...extra });
  const pager = h('p', { class: 'pager' }, after ? link(here({}), '⇤ First page') : null,
    d.next ? h('a', { href: here({ after: d.next }), id: 'next-page', class: 'next-page' }, 'Next page →') : muted('last page'));
  const cellAB = (s, ps, l) => [passedTag(ps), s != null ? ` ${num(s)}` : '', l != null ? ` ${l}` : ''];
  const rows = (d.rows || []).map((r) => h('tr', { 'data-call-id': r.call_id, 'data-href': answerPath(id, r.call_id), class: 'clickable' },
    td(r.test), td(r.model),
    h('td', { class: 'snip', title: r.input ?? '' }, link(answerPath(id, r.call_id), r.input || '(empty)')), snip(r.response),
    h('td', { class: 'nowrap' }, cellAB(r.score_a, r.passed_a, r.label_a)), h('td', { class: 'nowrap' }, cellAB(r.score_b, r.passed_b, r.label_b))));
  const tbl = rows.length ? table({ id: 'diff-rows', class: 'grid answers' }, ['test', 'model', 'input', 'response', 'A', 'B'], rows)
    : empty('The two versions agree on every answer.');
  if (rows.length) rowLinks(tbl);
  box.replaceChildren(h('h1', null, 'Scorer versions: A vs B'), form, matrix, disagree,
    h('h2', null, 'Answers they disagree on'), pager, tbl);
}

// ---------------------------------------------------------------- view: SQL box
const DEFAULT_SQL = 'SELECT test, count(*) AS n FROM scores GROUP BY test ORDER BY n DESC';
const TABLES = ['cases', 'calls', 'validity', 'scores', 'results'];

async function viewSql(ctx, box, id) {
  runCrumbs(id, ['SQL']);
  const q = ctx.params.get('q');
  const input = h('textarea', { id: 'sql-input', rows: 6, spellcheck: 'false', value: q || DEFAULT_SQL });
  const runBtn = h('button', { type: 'button', id: 'sql-run', class: 'primary' }, 'Run');
  const err = h('div', { id: 'sql-error', class: 'error-box', hidden: true });
  const result = h('div', { id: 'sql-result' });
  let csvUrl = null;

  const run = async () => {
    const sql = input.value.trim();
    if (!sql) return;
    history.replaceState(null, '', runPath(id) + '/sql' + qs({ q: sql }));
    setReady('0');
    err.hidden = true;
    runBtn.disabled = true;
    result.replaceChildren(h('p', { class: 'muted' }, h('span', { class: 'spinner' }), 'running…'));
    const t0 = performance.now();
    try {
      const d = await api(`/api/runs/${enc(id)}/sql`, { method: 'POST', body: { sql }, signal: ctx.signal });
      if (csvUrl) URL.revokeObjectURL(csvUrl);
      csvUrl = URL.createObjectURL(new Blob([toCsv(d.columns, d.rows)], { type: 'text/csv' }));
      const ms = Math.round(performance.now() - t0);
      result.replaceChildren(
        h('p', { class: 'status-line' }, h('span', { id: 'sql-count', 'data-rows': d.rows.length }, `${d.rows.length} row${d.rows.length === 1 ? '' : 's'} · ${ms} ms`),
          d.truncated ? h('span', { class: 'warn', id: 'sql-truncated' }, 'truncated: only the first rows are shown') : null,
          h('a', { href: csvUrl, download: 'query.csv', id: 'sql-csv' }, 'Download CSV'), ' ',
          h('button', { type: 'button', class: 'linkish', id: 'sql-parquet', title: `the query's rows as Parquet (at most 100,000)`,
            onclick: () => downloadParquet(id, sql, err) }, 'Download Parquet')),
        table({ class: 'grid sql' }, d.columns, d.rows.map((r) => h('tr', null, (Array.isArray(r) ? r : d.columns.map((c) => r[c])).map((v) =>
          h('td', { class: typeof v === 'number' ? 'n' : v == null ? 'null' : null }, v == null ? 'null' : cellText(v)))))));
    } catch (e) {
      if (isAbort(e) || !ctx.alive()) return;
      result.replaceChildren();
      err.replaceChildren(h('b', null, e.status ? `HTTP ${e.status}` : 'Error'), ': ', e.message);
      err.hidden = false;
    } finally {
      runBtn.disabled = false;
      if (ctx.alive()) setReady('1');
    }
  };
  runBtn.addEventListener('click', run);
  input.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) { e.preventDefault(); run(); }
  });
  box.replaceChildren(h('h1', null, 'SQL'),
    h('p', { class: 'muted' }, 'Read-only queries over the run\'s tables: ',
      TABLES.map((t) => [h('button', { type: 'button', class: 'linkish', title: `SELECT * FROM ${t} LIMIT 100`,
        onclick: () => { input.value = `SELECT * FROM ${t} LIMIT 100`; input.focus(); } }, t), ' ']),
      '· every evalflow function · at most 1,000 rows shown.'),
    input, h('div', { class: 'bar' }, runBtn, muted('Ctrl+Enter runs')), err, result);
  if (q) await run();
  else input.focus();
}

/** The query's rows as a Parquet file, built by the server (`POST .../sql.parquet`). */
async function downloadParquet(id, sql, err) {
  const headers = { 'Content-Type': 'application/json' };
  const t = token();
  if (t) headers.Authorization = 'Bearer ' + t;
  try {
    const res = await fetch(`/api/runs/${enc(id)}/sql.parquet`, { method: 'POST', headers, credentials: 'same-origin',
      body: JSON.stringify({ sql }) });
    if (!res.ok) {
      let msg = res.statusText;
      try { msg = (await res.json()).error || msg; } catch { /* not JSON */ }
      throw new ApiError(res.status, msg);
    }
    const url = URL.createObjectURL(await res.blob());
    const a = h('a', { href: url, download: 'query.parquet', hidden: true });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  } catch (e) {
    err.replaceChildren(h('b', null, e.status ? `HTTP ${e.status}` : 'Error'), ': ', e.message);
    err.hidden = false;
  }
}

/** RFC 4180 CSV of a result. */
function toCsv(cols, rows) {
  const f = (v) => {
    const s = v == null ? '' : typeof v === 'object' ? JSON.stringify(v) : String(v);
    return /[",\r\n]/.test(s) ? '"' + s.replace(/"/g, '""') + '"' : s;
  };
  return [cols, ...rows].map((r) => r.map(f).join(',')).join('\r\n') + '\r\n';
}

// ---------------------------------------------------------------- view: compare
async function viewCompare(ctx, box) {
  const a = ctx.params.get('a'), b = ctx.params.get('b');
  setCrumbs([['compare' + (a && b ? `: ${a} vs ${b}` : '')]]);
  const runs = await ctx.get('/api/runs');
  const form = compareForm(runs, a, b);
  form.querySelectorAll('select').forEach((s) => s.addEventListener('change', () => form.requestSubmit()));
  box.replaceChildren(h('h1', null, 'Compare two runs'), form);
  if (!a || !b) {
    add(box, [h('p', { class: 'muted' }, 'Pick a baseline A and a candidate B: the rows pair their cases per test (B − A).')]);
    return;
  }
  add(box, [h('p', { class: 'muted loading' }, 'loading…')]);
  const d = await ctx.get('/api/compare' + qs({ a, b }));
  const rows = d.rows || [];
  const cols = [];
  for (const r of rows) for (const k of Object.keys(r)) if (!cols.includes(k)) cols.push(k);
  // The verdict reads best right after the row's name.
  if (cols.includes('verdict') && cols.includes('test')) cols.splice(cols.indexOf('test') + 1, 0, ...cols.splice(cols.indexOf('verdict'), 1));
  const vclass = (v) => (/^B better/.test(v) ? 'v-b' : /^A better/.test(v) ? 'v-a' : 'v-none');
  const tbl = rows.length ? h('div', { class: 'scroll-x' }, table({ id: 'compare-table', class: 'grid compare' }, cols.map((k) => (k === 'verdict' ? h('th', { class: 'verdict-cell' }, k) : k)),
    rows.map((r) => h('tr', { class: 'lvl-' + (r.level || ''), 'data-level': r.level ?? '', 'data-test': r.test ?? '', 'data-verdict': r.verdict ?? '' },
      cols.map((k) => {
        const v = r[k];
        if (k === 'verdict') return h('td', { class: 'verdict-cell ' + vclass(String(v)) }, v ?? '');
        return h('td', { class: typeof v === 'number' ? 'n' : null }, cellText(v));
      })))))
    : empty('No paired rows.');
  const flipped = d.flipped || [];
  const fl = flipped.length ? h('ul', { id: 'flipped', class: 'flipped' }, flipped.map((f) =>
    h('li', { 'data-case-id': f.case_id },
      h('span', null, f.test ?? ''), ' ', h('code', { class: 'muted' }, f.case_id),
      ' A ', passedTag(f.passed_a), ' → B ', passedTag(f.passed_b), ' · ',
      f.call_a ? link(answerPath(d.a || a, f.call_a), 'answer in A') : 'no answer in A', ' · ',
      f.call_b ? link(answerPath(d.b || b, f.call_b), 'answer in B') : 'no answer in B')))
    : empty('No answer flipped.');
  box.replaceChildren(h('h1', null, 'Compare two runs'), form,
    h('p', { class: 'links' }, 'A ', link(runPath(d.a || a), d.a || a), ' · B ', link(runPath(d.b || b), d.b || b), muted('diff = B − A')),
    tbl, h('h2', null, `Flipped answers (${int(flipped.length)})`), fl);
}

// ---------------------------------------------------------------- boot
function boot() {
  // ?token=T: keep it for the API's Authorization header and drop it from the visible URL.
  const u = new URL(location.href);
  const t = u.searchParams.get('token');
  if (t) {
    memToken = t;
    try { sessionStorage.setItem(TOKEN_KEY, t); } catch { /* memory only */ }
    u.searchParams.delete('token');
    history.replaceState(null, '', u.pathname + u.search + u.hash);
  }
  shell();
  window.addEventListener('error', (e) => { showError(e.error || new Error(e.message)); setReady('1'); });
  window.addEventListener('unhandledrejection', (e) => { if (!isAbort(e.reason)) showError(e.reason || new Error('unhandled rejection')); });
  render();
}

if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', boot);
else boot();
})();
