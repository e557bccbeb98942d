// A scripted browser session against a running `evalflow view` (tests/view.rs runs it):
//   node --experimental-websocket tests/view_browser/drive.js BASE [RUN]
// BASE is the viewer's http://127.0.0.1:PORT, RUN a run id under it with a checklist@2 scorer
// (default `a`). Raw Chrome DevTools Protocol over node 20's WebSocket: no npm package.
//
// It launches headless Chromium (CHROMIUM, else `chromium` / `chromium-browser` on PATH) with
// a throwaway profile, drives the page like a user (clicks, a select, typing, back/forward,
// Ctrl+Enter) and checks every view against the JSON API it fetches itself. Every request the
// page makes is recorded: none may leave 127.0.0.1. Prints one PASS/FAIL line per check and
// exits 1 on any failure, 2 when the session itself broke.
'use strict';
const { spawn, execFileSync } = require('child_process');
const fs = require('fs');
const os = require('os');
const path = require('path');

const BASE = (process.argv[2] || '').replace(/\/+$/, '');
const RUN = process.argv[3] || 'a';
if (!/^http:\/\/127\.0\.0\.1:\d+$/.test(BASE)) {
  console.error('usage: node --experimental-websocket drive.js http://127.0.0.1:PORT [RUN]');
  process.exit(2);
}
if (typeof WebSocket === 'undefined') {
  console.error('no global WebSocket: run node 20+ with --experimental-websocket');
  process.exit(2);
}
const ORIGIN = new URL(BASE).origin;
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const enc = encodeURIComponent;

function chromiumPath() {
  if (process.env.CHROMIUM) return process.env.CHROMIUM;
  for (const name of ['chromium', 'chromium-browser', 'google-chrome']) {
    try {
      return execFileSync('sh', ['-c', `command -v ${name}`]).toString().trim();
    } catch { /* next */ }
  }
  throw new Error('chromium is not installed');
}

let chrome = null;
let profile = null;
/** Kills Chromium and removes its profile (best effort: it may still be writing there). */
function cleanup() {
  if (chrome && chrome.exitCode === null && chrome.signalCode === null) chrome.kill('SIGKILL');
  if (profile) {
    try {
      fs.rmSync(profile, { recursive: true, force: true, maxRetries: 10, retryDelay: 50 });
    } catch { /* left in the temp folder */ }
    profile = null;
  }
}
/** Ends Chromium, waits for it (at most 5 s), then removes its profile. */
async function stopChromium() {
  if (chrome && chrome.exitCode === null && chrome.signalCode === null) {
    const exited = new Promise((r) => chrome.once('exit', r));
    chrome.kill('SIGKILL');
    await Promise.race([exited, sleep(5000)]);
  }
  cleanup();
}
process.on('exit', cleanup);

// ---------------------------------------------------------------- checks
let fails = 0;
let passes = 0;
function check(name, ok, extra = '') {
  console.log((ok ? 'PASS ' : 'FAIL ') + name + (ok || !extra ? '' : '  ' + extra));
  if (ok) passes++; else fails++;
}
const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);

/** The viewer's API, fetched by this script (not by the page). */
async function api(p) {
  const r = await fetch(BASE + p);
  const body = await r.json();
  if (!r.ok) throw new Error(`${p}: HTTP ${r.status} ${JSON.stringify(body)}`);
  return body;
}
async function apiPost(p, body) {
  const r = await fetch(BASE + p, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });
  return { status: r.status, body: await r.json() };
}
const qs = (o) => {
  const p = new URLSearchParams();
  for (const [k, v] of Object.entries(o)) if (v != null && v !== '') p.set(k, v);
  const s = p.toString();
  return s ? '?' + s : '';
};

async function main() {
  profile = fs.mkdtempSync(path.join(os.tmpdir(), 'evalflow-view-drive-'));
  chrome = spawn(chromiumPath(), [
    '--headless', '--no-sandbox', '--disable-gpu', '--remote-debugging-port=0',
    `--user-data-dir=${profile}`, '--no-first-run', '--disable-background-networking',
    '--disable-component-update', '--disable-sync', '--disable-quic', '--window-size=1280,900',
    'about:blank',
  ], { stdio: 'ignore' });

  // The DevTools port Chromium picked (--remote-debugging-port=0), from its profile.
  let port = null;
  for (let i = 0; i < 150 && !port; i++) {
    try {
      port = fs.readFileSync(path.join(profile, 'DevToolsActivePort'), 'utf8').split('\n')[0].trim();
    } catch { await sleep(100); }
  }
  if (!port) throw new Error('chromium did not open its DevTools port');
  let target = null;
  for (let i = 0; i < 100 && !target; i++) {
    try {
      const list = await (await fetch(`http://127.0.0.1:${port}/json/list`)).json();
      target = list.find((t) => t.type === 'page');
    } catch { /* not yet */ }
    if (!target) await sleep(100);
  }
  if (!target) throw new Error('no page target');

  const ws = new WebSocket(target.webSocketDebuggerUrl);
  await new Promise((resolve, reject) => {
    ws.addEventListener('open', resolve);
    ws.addEventListener('error', () => reject(new Error('DevTools websocket failed')));
  });
  let seq = 0;
  const pending = new Map();
  const exceptions = [];
  const requests = []; // {url, frameId, loaderId, initiator}
  ws.addEventListener('message', (m) => {
    const d = JSON.parse(m.data);
    if (d.id && pending.has(d.id)) {
      pending.get(d.id)(d);
      pending.delete(d.id);
      return;
    }
    if (d.method === 'Runtime.exceptionThrown') {
      const x = d.params.exceptionDetails;
      exceptions.push((x.exception && x.exception.description) || x.text);
    }
    if (d.method === 'Network.requestWillBeSent') {
      const p = d.params;
      requests.push({ url: p.request.url, frameId: p.frameId, loaderId: p.loaderId, initiator: p.initiator && p.initiator.type });
    }
  });
  const send = (method, params = {}) => new Promise((resolve, reject) => {
    const id = ++seq;
    const t = setTimeout(() => { pending.delete(id); reject(new Error(`${method}: no answer in 30 s`)); }, 30000);
    pending.set(id, (d) => { clearTimeout(t); d.error ? reject(new Error(`${method}: ${d.error.message}`)) : resolve(d.result); });
    ws.send(JSON.stringify({ id, method, params }));
  });
  await send('Runtime.enable');
  await send('Page.enable');
  await send('Network.enable');
  await send('Network.setCacheDisabled', { cacheDisabled: true });
  const frame = (await send('Page.getFrameTree')).frameTree.frame.id;

  /** Evaluates an async function body in the page; returns its value. */
  const ev = async (body) => {
    const r = await send('Runtime.evaluate', { expression: `(async () => { ${body} })()`, awaitPromise: true, returnByValue: true });
    if (r.exceptionDetails) throw new Error((r.exceptionDetails.exception && r.exceptionDetails.exception.description) || r.exceptionDetails.text);
    return r.result.value;
  };
  /** Waits for the view to finish rendering: body[data-ready="1"] twice in a row. */
  const ready = async () => {
    await sleep(50);
    const ok = await ev(`for (let i = 0, n = 0; i < 400; i++) {
      n = document.body && document.body.dataset.ready === '1' ? n + 1 : 0;
      if (n >= 2) return true;
      await new Promise((r) => setTimeout(r, 25));
    } return false;`);
    if (!ok) throw new Error('the page never became ready: ' + await ev('return location.href'));
  };
  const goto = async (url) => { await send('Page.navigate', { url: BASE + url }); await sleep(200); await ready(); };
  const href = () => ev('return location.pathname + location.search');
  const params = async () => Object.fromEntries(new URLSearchParams(await ev('return location.search')));
  const rowIds = () => ev(`return [...document.querySelectorAll('#answers-table tr[data-call-id]')].map((tr) => tr.dataset.callId)`);
  const rowTests = () => ev(`return [...document.querySelectorAll('#answers-table tr[data-call-id] td:first-child')].map((td) => td.textContent)`);
  /** Clicks the centre of the element `sel` with real mouse events. */
  const click = async (sel) => {
    const box = await ev(`const el = document.querySelector(${JSON.stringify(sel)});
      if (!el) return null; el.scrollIntoView({ block: 'center' });
      const r = el.getBoundingClientRect(); return { x: r.left + r.width / 2, y: r.top + r.height / 2 };`);
    if (!box) throw new Error(`nothing to click at ${sel}`);
    for (const type of ['mouseMoved', 'mousePressed', 'mouseReleased']) {
      await send('Input.dispatchMouseEvent', { type, x: box.x, y: box.y, button: 'left', clickCount: type === 'mouseMoved' ? 0 : 1 });
    }
  };
  const key = async (k, code, vk, modifiers = 0, text) => {
    await send('Input.dispatchKeyEvent', { type: 'keyDown', key: k, code, windowsVirtualKeyCode: vk, modifiers, text });
    await send('Input.dispatchKeyEvent', { type: 'keyUp', key: k, code, windowsVirtualKeyCode: vk, modifiers });
  };
  const apiIds = async (filters) => (await api(`/api/runs/${enc(RUN)}/answers` + qs(filters))).rows.map((r) => r.call_id);

  // ------------------------------------------------------------ 1. run page -> answers
  const results = await api(`/api/runs/${enc(RUN)}/results`);
  // A test with failures and passes under checklist@2, so that filters change the rows.
  const row = results.filter((r) => r.level === 'test' && r.scorer === 'checklist' && r.scoring_version === '2' && r.value > 0 && r.value < 1)
    .sort((a, b) => b.n - a.n)[0];
  if (!row) throw new Error('the run has no test with both passes and failures');
  const test = row.test;
  await goto(`/runs/${enc(RUN)}`);
  check('run page shows its forest', await ev(`return document.querySelectorAll('#forest tr[data-result-row]').length`) > 0);
  await ev('window.__same_page = 42; return 1');
  await click(`#forest tr[data-result-row][data-level="test"][data-test=${JSON.stringify(test)}] td.name a`);
  await ready();
  const p1 = await params();
  check('forest row click opens its answers', (await ev('return location.pathname')) === `/runs/${RUN}/answers` && p1.test === test,
    await href());
  check('navigation stays in the page (no reload)', await ev('return window.__same_page') === 42);
  const f1 = { test, model: p1.model, scorer: p1.scorer };
  const ids1 = await rowIds();
  check('answers rows are the API page of the forest row', ids1.length > 0 && same(ids1, await apiIds(f1)), `${ids1.length} rows`);
  check('answers rows are all of the test', (await rowTests()).every((t) => t === test));

  // ------------------------------------------------------------ 2. a filter select
  await ev(`const s = document.getElementById('f-passed'); s.value = 'false'; s.dispatchEvent(new Event('change', { bubbles: true })); return 1`);
  await ready();
  const p2 = await params();
  check('changing the passed select changes the URL', p2.passed === 'false' && p2.test === test, await href());
  const f2 = { ...f1, passed: 'false' };
  const ids2 = await rowIds();
  const api2 = await api(`/api/runs/${enc(RUN)}/answers` + qs(f2));
  check('filtered rows are the API page', ids2.length > 0 && same(ids2, api2.rows.map((r) => r.call_id)), `${ids2.length} rows`);
  check('filtered rows all failed', api2.rows.every((r) => r.passed === false)
    && await ev(`return [...document.querySelectorAll('#answers-table tr[data-call-id] .fail')].length`) === ids2.length);

  // ------------------------------------------------------------ 3. typing a search
  // A word of the first failing answer's input, so the search has rows.
  const word = (api2.rows[0].input || '').split(/[^A-Za-z]+/).filter((w) => w.length >= 4).sort((a, b) => b.length - a.length)[0] || 'the';
  await ev(`const q = document.getElementById('f-q'); q.focus(); q.select(); return 1`);
  await send('Input.insertText', { text: word });
  await key('Enter', 'Enter', 13, 0, '\r');
  await ready();
  const p3 = await params();
  check('typed search is in the URL', p3.q === word && p3.passed === 'false' && p3.test === test, await href());
  const ids3 = await rowIds();
  const api3 = await api(`/api/runs/${enc(RUN)}/answers` + qs({ ...f2, q: word }));
  check('search rows are the API page', ids3.length > 0 && same(ids3, api3.rows.map((r) => r.call_id)), `${word}: ${ids3.length} rows`);
  check('search rows contain the word', api3.rows.length > 0 && api3.rows.every((r) => `${r.input} ${r.response}`.toLowerCase().includes(word.toLowerCase())));
  check('the search box keeps the word', await ev(`return document.getElementById('f-q').value`) === word);

  // ------------------------------------------------------------ 4. back and forward
  await ev('history.back(); return 1');
  await ready();
  check('back returns to the filter without the search', !(await params()).q && (await params()).passed === 'false', await href());
  check('back shows the filter\'s rows again', same(await rowIds(), ids2));
  check('back restores the select', await ev(`return document.getElementById('f-passed').value`) === 'false'
    && await ev(`return document.getElementById('f-q').value`) === '');
  await ev('history.back(); return 1');
  await ready();
  check('back again drops the filter', !(await params()).passed && same(await rowIds(), ids1), await href());
  await ev('history.forward(); return 1');
  await ready();
  await ev('history.forward(); return 1');
  await ready();
  check('forward twice returns to the search', (await params()).q === word && same(await rowIds(), ids3), await href());

  // ------------------------------------------------------------ 5. one answer
  const callId = ids3[0];
  await click(`#answers-table tr[data-call-id="${callId}"] td:nth-child(2)`);
  await ready();
  check('row click opens the answer', (await ev('return location.pathname')) === `/runs/${RUN}/answers/${callId}`, await href());
  const one = await api(`/api/runs/${enc(RUN)}/answers/${enc(callId)}`);
  check('answer page is that call', await ev(`return document.getElementById('answer-detail').dataset.callId`) === callId);
  check('answer page shows the response', await ev(`return document.querySelector('#answer-detail [data-field="response"]').textContent`) === one.call.response);
  check('answer page shows the input', await ev(`return document.querySelector('#answer-detail [data-field="input"]').textContent`) === one.case.input);
  check('answer page lists every scorer version', same(
    await ev(`return [...document.querySelectorAll('#scores-table tr[data-scorer]')].map((tr) => tr.dataset.scorer)`),
    one.scores.map((s) => `${s.scorer}@${s.scoring_version}`)));
  await ev('history.back(); return 1');
  await ready();
  check('back from the answer returns to the search', (await params()).q === word && same(await rowIds(), ids3), await href());

  // ------------------------------------------------------------ 6. the SQL box
  await goto(`/runs/${enc(RUN)}/sql`);
  const sql = "SELECT count(*) AS n FROM scores WHERE scorer = 'checklist' AND NOT passed";
  await ev(`const t = document.getElementById('sql-input'); t.focus(); t.select(); return 1`);
  await send('Input.insertText', { text: sql });
  await key('Enter', 'Enter', 13, 2 /* Ctrl */);
  await sleep(100);
  await ready();
  const want = await apiPost(`/api/runs/${enc(RUN)}/sql`, { sql });
  check('Ctrl+Enter runs the query and puts it in the URL', (await params()).q === sql, await href());
  check('the SQL box shows one row', await ev(`return document.getElementById('sql-count').dataset.rows`) === '1');
  check('the SQL box shows the API\'s count', want.status === 200
    && await ev(`return document.querySelector('#sql-result tbody td').textContent`) === String(want.body.rows[0][0]),
  JSON.stringify(want.body));
  await ev(`const t = document.getElementById('sql-input'); t.focus(); t.select(); return 1`);
  await send('Input.insertText', { text: 'DROP TABLE calls' });
  await key('Enter', 'Enter', 13, 2);
  await sleep(100);
  await ready();
  check('a statement that writes shows its 400', await ev(`const e = document.getElementById('sql-error'); return !e.hidden && e.textContent.includes('400')`));

  // ------------------------------------------------------------ 7. the network
  await sleep(300);
  const mine = requests.filter((r) => r.frameId === frame);
  const bad = mine.filter((r) => {
    const u = new URL(r.url);
    if (u.protocol === 'data:' || u.protocol === 'blob:') return false;
    return u.origin !== ORIGIN;
  });
  check('the page made requests (recorded)', mine.length >= 10 && mine.some((r) => new URL(r.url).pathname.startsWith('/api/')), `${mine.length}`);
  check('no request leaves 127.0.0.1', bad.length === 0, bad.map((r) => r.url).join(' '));
  check('no exception in the page', exceptions.length === 0, exceptions.join(' | '));

  ws.close();
  console.log(`${passes} passed, ${fails} failed`);
  await stopChromium();
  process.exit(fails ? 1 : 0);
}

const deadline = setTimeout(() => { console.log('FAIL the session took more than 120 s'); cleanup(); process.exit(2); }, 120000);
deadline.unref();
main().catch(async (e) => {
  console.log('FAIL the session broke: ' + ((e && e.stack) || e));
  await stopChromium();
  process.exit(2);
});
