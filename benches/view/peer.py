#!/usr/bin/env python3
"""`evalflow view` against Inspect AI's `inspect view`: a user's first look at one large log.

What it measures. For each size N it has Inspect itself write a real log of N samples (a task
of short questions with a target, solver `generate()`, scorer `includes()`, the built-in
`mockllm/model`, `--log-format eval`), then serves that same data with each viewer, whole
process against whole process, and times over loopback (wall time, first request of each kind
on a freshly started server) what a user's first look costs:

  listen   the server process started -> its port accepts a connection
  list     the log list: Inspect's page asks GET /api/log-files then GET /api/log-headers?file=
           (the server reads each log's header.json); evalflow's asks GET /api/runs
  open     opening the log with its sample list. Inspect's page does this in the browser: GET
           /api/log-info/LOG (size), then byte ranges of the zip through GET /api/log-bytes
           (end of central directory, the central directory in 8 MiB chunks, header.json and
           summaries.json, all of them fetched), zstd-decompressed and JSON-parsed on the
           client: this bench's client does the same in Python (C zstandard + json), so its
           figure is a lower bound of what a browser does before it can draw the list.
           evalflow's page asks GET /api/runs/{id} and GET /api/runs/{id}/answers?limit=50.
  one      one sample (the middle one of the list): Inspect reads samples/ID_epoch_1.json by
           byte range and decodes it; evalflow asks GET /api/runs/{id}/answers/{call_id}
  search   evalflow: GET /answers?q=WORD (first page of hits) / q=a string that is nowhere (a
           full scan). Inspect has no server-side search: its sample filter runs in the
           browser over the summaries already loaded (input, target, scores; not the
           responses), timed here the same way as `hit / miss` over the parsed summaries.
  RSS      the server's peak resident set (VmHWM of the process and of any child it spawns,
           polled every 50 ms) and the client's own peak (for Inspect that is where the
           decoding happens: in a real browser it is the tab's memory, inspect_ai #1375).

  page     with --browser CHROMIUM only: a fresh server, the viewer's own page opened in
           headless Chromium (driven over the DevTools protocol) on the log's sample list
           (Inspect: /#/logs/LOG; evalflow: /runs/{id}/answers), timed from navigation until a
           sample's input is on screen; `tab MB` is the renderer's peak RSS (VmHWM).

evalflow's run is made from Inspect's log by `evalflow import LOG --out RUN` (timed) and
`evalflow validate RUN/import.toml --out RUN` (so the viewer has validity verdicts); the
scores are Inspect's own, imported as `inspect-includes@imported`.

Usage (Python 3.11, stdlib only; the Inspect client re-runs this file under the venv's Python,
which has the `zstandard` package that inspect_ai installs):

  python3 -m venv /tmp/peer-venv && /tmp/peer-venv/bin/pip install inspect_ai==0.3.285
  python3 benches/view/peer.py --inspect-venv /tmp/peer-venv --bin target/release/evalflow \
      --sizes 10000,100000 --work /tmp/peer-work [--reps 1] [--eval-timeout 3600] \
      [--browser /usr/bin/chromium]

The commands it runs, per size N (WORK = --work):

  VENV/bin/inspect eval WORK/task.py@peer -T n=N --model mockllm/model --log-format eval \
      --log-dir WORK/logs-N --display none --no-log-realtime      (skipped if the log exists)
  VENV/bin/inspect view --log-dir WORK/logs-N --port P
  BIN import WORK/logs-N/LOG.eval --out WORK/runs-N/inspect-N
  BIN validate WORK/runs-N/inspect-N/import.toml --out WORK/runs-N/inspect-N
  BIN view WORK/runs-N --addr 127.0.0.1:0

`mockllm/model`'s default output counts tokens with tiktoken, which downloads its BPE file at
run time; with no network the eval fails, so the task hands mockllm a `custom_outputs`
function that gives the usage itself (and answers the word in two samples of three, so the
scores are mixed). `--no-log-realtime` only turns off the live-view buffer; the log is the same.
"""
import argparse
import base64
import concurrent.futures
import http.client
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
import zipfile
import zlib

TASK = '''from inspect_ai import Task, task
from inspect_ai.dataset import MemoryDataset, Sample
from inspect_ai.model import ModelOutput, ModelUsage, get_model
from inspect_ai.scorer import includes
from inspect_ai.solver import generate

WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "piano", "ocean", "amber", "lemon"]


def answer(input, tools, tool_choice, config):
    # mockllm's default output counts tokens with tiktoken, which downloads its BPE file:
    # give the usage here. Two answers in three name the word.
    text = input[-1].text
    i = int(text.split(":")[0].split()[-1])
    content = f"The word is {WORDS[i % 10]}." if i % 3 else "I am not sure."
    out = ModelOutput.from_content(model="mockllm", content=content)
    out.usage = ModelUsage(input_tokens=len(text.split()), output_tokens=len(content.split()),
                           total_tokens=len(text.split()) + len(content.split()))
    return out


@task
def peer(n: int = 100):
    n = int(n)
    samples = [
        Sample(id=i + 1,
               input=f"Question {i}: repeat the word {WORDS[i % 10]} and say which number this is.",
               target=WORDS[i % 10],
               metadata={"template": f"t{i % 50}"})
        for i in range(n)
    ]
    return Task(dataset=MemoryDataset(samples), solver=generate(), scorer=includes(),
                model=get_model("mockllm/model", custom_outputs=answer))
'''

HIT, MISS = "tiger", "zqxjzqxj"


# ---------------------------------------------------------------- process helpers

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, deadline):
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.01)
    return False


def tree(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
        except OSError:
            pass
    return out


def hwm_kb(pid):
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class RssWatch:
    """Peak RSS of a process and its children: the sum of each one's VmHWM, polled."""

    def __init__(self, pid):
        self.pid, self.peaks, self.stop = pid, {}, False
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        while not self.stop:
            self.sample()
            time.sleep(0.05)

    def sample(self):
        for p in tree(self.pid):
            self.peaks[p] = max(self.peaks.get(p, 0), hwm_kb(p))

    def done(self):
        self.sample()
        self.stop = True
        self.t.join()
        return sum(self.peaks.values()) / 1024, len(self.peaks)


def stop(proc):
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def du_mb(path):
    total = 0
    for d, _, fs in os.walk(path):
        total += sum(os.path.getsize(os.path.join(d, f)) for f in fs)
    return total / 1e6


# ---------------------------------------------------------------- HTTP client

class Http:
    def __init__(self, port):
        self.port = port
        self.c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        self.bytes = 0

    def get(self, path, headers=None):
        self.c.request("GET", path, headers=headers or {})
        r = self.c.getresponse()
        body = r.read()
        self.bytes += len(body)
        if r.status != 200:
            raise RuntimeError(f"GET {path}: {r.status} {body[:200]!r}")
        return body

    def json(self, path):
        return json.loads(self.get(path))


def timed(f):
    t = time.perf_counter()
    v = f()
    return time.perf_counter() - t, v


# ---------------------------------------------------------------- Inspect's page, as a client

class RemoteZip:
    """The viewer's openRemoteZipFile: the archive read through GET /api/log-bytes ranges."""

    CHUNK, PARALLEL = 8 * 1024 * 1024, 10

    def __init__(self, port, name, size):
        self.port, self.q, self.size = port, urllib.parse.quote(name, safe=""), size
        self.local = threading.local()
        self.bytes = 0

    def _http(self):
        if not hasattr(self.local, "h"):
            self.local.h = Http(self.port)
        return self.local.h

    def _chunk(self, start, count):
        h = self._http()
        b = h.get(f"/api/log-bytes/{self.q}?start={start}&end={start + count - 1}")
        if len(b) != count:
            raise RuntimeError("short range read")
        self.bytes += len(b)
        return b

    def read(self, start, size):
        if size <= self.CHUNK:
            return self._chunk(start, size)
        offs = list(range(start, start + size, self.CHUNK))
        with concurrent.futures.ThreadPoolExecutor(min(len(offs), self.PARALLEL)) as ex:
            parts = ex.map(lambda o: self._chunk(o, min(self.CHUNK, start + size - o)), offs)
            return b"".join(parts)

    def open(self):
        eocd = self.read(self.size - 22, 22)
        assert struct.unpack_from("<I", eocd, 0)[0] == 0x06054B50, "no EOCD"
        cd_size, cd_off = struct.unpack_from("<II", eocd, 12)
        if cd_off == 0xFFFFFFFF or cd_size == 0xFFFFFFFF:
            loc = self.read(self.size - 42, 20)
            z64 = self.read(struct.unpack_from("<Q", loc, 8)[0], 56)
            cd_size, cd_off = struct.unpack_from("<QQ", z64, 40)
        cd = self.read(cd_off, cd_size)
        self.entries, p = {}, 0
        while p + 46 <= len(cd) and struct.unpack_from("<I", cd, p)[0] == 0x02014B50:
            method, = struct.unpack_from("<H", cd, p + 10)
            csize, usize, nlen, elen, clen = struct.unpack_from("<IIHHH", cd, p + 20)
            off, = struct.unpack_from("<I", cd, p + 42)
            name = cd[p + 46:p + 46 + nlen].decode()
            extra = cd[p + 46 + nlen:p + 46 + nlen + elen]
            vals = [v for v in (usize, csize, off) if v == 0xFFFFFFFF]
            e = 0
            while vals and e + 4 <= len(extra):
                tag, ln = struct.unpack_from("<HH", extra, e)
                if tag == 1:
                    q, k = list(struct.unpack_from(f"<{ln // 8}Q", extra, e + 4)), 0
                    if usize == 0xFFFFFFFF:
                        usize, k = q[k], k + 1
                    if csize == 0xFFFFFFFF:
                        csize, k = q[k], k + 1
                    if off == 0xFFFFFFFF:
                        off = q[k]
                    break
                e += 4 + ln
            self.entries[name] = (method, csize, usize, off, nlen)
            p += 46 + nlen + elen + clen
        return self

    def read_file(self, name):
        method, csize, usize, off, nlen = self.entries[name]
        est = min(30 + nlen + csize + 256, self.size - off)
        data = self.read(off, est)
        n, e = struct.unpack_from("<HH", data, 26)
        total = 30 + n + e + csize
        if total > len(data):
            data = self.read(off, total)
        raw = data[30 + n + e:total]
        if method == 0:
            return raw
        if method == 8:
            return zlib.decompressobj(-15).decompress(raw)
        if method == 93:
            import zstandard  # the Inspect venv's Python has it (inspect_ai depends on it)
            return zstandard.ZstdDecompressor().decompress(raw, max_output_size=usize)
        raise RuntimeError(f"compression method {method}")

    def read_json(self, name):
        return json.loads(self.read_file(name))


def client_inspect(port):
    h = Http(port)
    r = {}
    # the log list: the listing, then the headers of the logs shown (the page's previews)
    t, files = timed(lambda: h.json("/api/log-files")["files"])
    name = files[0]["name"]
    t2, heads = timed(lambda: h.json("/api/log-headers?" + urllib.parse.urlencode({"file": name})))
    r["list"] = t + t2
    r["list_detail"] = f"log-files {t:.3f} + log-headers {t2:.3f}"
    # opening the log: size, zip directory, header.json and summaries.json, decoded
    t0 = time.perf_counter()
    size = h.json(f"/api/log-info/{urllib.parse.quote(name, safe='')}")["size"]
    z = RemoteZip(port, name, size).open()
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        fh, fs = ex.submit(z.read_json, "header.json"), ex.submit(z.read_json, "summaries.json")
        header, summaries = fh.result(), fs.result()
    r["open"] = time.perf_counter() - t0
    r["open_bytes"] = z.bytes
    r["samples"] = len(summaries)
    r["zip_entries"] = len(z.entries)
    r["status"] = header.get("status")
    # one sample: the middle of the list
    mid = summaries[len(summaries) // 2]
    t, s = timed(lambda: z.read_json(f"samples/{mid['id']}_epoch_{mid['epoch']}.json"))
    r["one"] = t
    r["one_detail"] = f"sample {mid['id']}: {len(s.get('events', []))} events"

    # search: the viewer filters the loaded summaries in the browser
    def filt(word):
        w = word.lower()
        return [x for x in summaries
                if w in json.dumps(x.get("input", "")).lower()
                or w in json.dumps(x.get("target", "")).lower()]

    th, hits = timed(lambda: filt(HIT))
    tm, _ = timed(lambda: filt(MISS))
    r["search"] = f"{th:.3f}/{tm:.3f}c"
    r["search_detail"] = f"client filter over summaries: {len(hits)} hits for {HIT!r}"
    return r


def client_evalflow(port):
    h = Http(port)
    r = {}
    t, runs = timed(lambda: h.json("/api/runs"))
    r["list"] = t
    run = runs[0]["run_id"]
    t1, info = timed(lambda: h.json(f"/api/runs/{run}"))
    t2, page = timed(lambda: h.json(f"/api/runs/{run}/answers?limit=50"))
    r["open"] = t1 + t2
    r["open_bytes"] = h.bytes
    r["samples"] = info.get("answers")
    rows = page["rows"]
    cid = rows[len(rows) // 2]["call_id"]
    t, one = timed(lambda: h.json(f"/api/runs/{run}/answers/{cid}"))
    r["one"] = t
    r["one_detail"] = f"{len(one.get('scores', []))} scores"
    th, hit = timed(lambda: h.json(f"/api/runs/{run}/answers?q={HIT}&limit=50"))
    tm, miss = timed(lambda: h.json(f"/api/runs/{run}/answers?q={MISS}&limit=50"))
    r["search"] = f"{th:.3f}/{tm:.3f}"
    r["search_detail"] = f"{len(hit['rows'])} hits on the first page, {len(miss['rows'])} for a miss"
    # the headline (the list's metric with its interval) is computed in the background
    t0 = time.perf_counter()
    while runs[0].get("headline_pending") and time.perf_counter() - t0 < 600:
        time.sleep(0.05)
        runs = h.json("/api/runs")
    r["headline"] = time.perf_counter() - t0 + r["list"]
    r["list_detail"] = f"headline ready {r['headline']:.3f}s after the first /api/runs"
    return r


def client_main(kind, port):
    r = client_inspect(port) if kind == "inspect" else client_evalflow(port)
    r["client_rss_mb"] = hwm_kb(os.getpid()) / 1024
    print(json.dumps(r))


# ---------------------------------------------------------------- a real browser (optional)

class DevTools:
    """A minimal client of Chromium's DevTools protocol (one WebSocket, text frames)."""

    def __init__(self, ws_url):
        host, path = ws_url[len("ws://"):].split("/", 1)
        self.s = socket.create_connection((host.rsplit(":", 1)[0], int(host.rsplit(":", 1)[1])))
        key = base64.b64encode(os.urandom(16)).decode()
        self.s.sendall((f"GET /{path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
                        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                        "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += self.s.recv(4096)
        self.buf, self.id = buf.split(b"\r\n\r\n", 1)[1], 0

    def _take(self, n):
        while len(self.buf) < n:
            d = self.s.recv(1 << 20)
            if not d:
                raise EOFError("devtools closed")
            self.buf += d
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _frame(self):
        payload = b""
        while True:
            b0, b1 = self._take(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._take(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._take(8))[0]
            payload += self._take(n)
            if b0 & 0x80:
                return json.loads(payload)

    def call(self, method, **params):
        self.id += 1
        data = json.dumps({"id": self.id, "method": method, "params": params}).encode()
        n, mask = len(data), os.urandom(4)
        hdr = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else
                               bytes([0xFE]) + struct.pack(">H", n) if n < 65536 else
                               bytes([0xFF]) + struct.pack(">Q", n))
        self.s.sendall(hdr + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))
        while True:
            msg = self._frame()
            if msg.get("id") == self.id:
                return msg.get("result", msg)


def browser_look(chromium, url, text, work, timeout=300):
    """Open url in headless Chromium; seconds until text is on the page, renderer peak RSS."""
    port = free_port()
    prof = os.path.join(work, f"chromium-profile-{port}")
    proc = subprocess.Popen([chromium, "--headless=new", "--no-sandbox", "--disable-gpu",
                             "--window-size=1400,1000", f"--remote-debugging-port={port}",
                             f"--user-data-dir={prof}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pages, deadline = [], time.time() + 60
        while not pages and time.time() < deadline:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/json/list")
                pages = [x for x in json.loads(c.getresponse().read()) if x["type"] == "page"]
            except OSError:
                time.sleep(0.05)
        dt = DevTools(pages[0]["webSocketDebuggerUrl"])
        dt.call("Performance.enable")
        t0, seen = time.perf_counter(), None
        dt.call("Page.navigate", url=url)
        probe = f"!!document.body && document.body.innerText.includes({json.dumps(text)})"
        while time.perf_counter() - t0 < timeout:
            if dt.call("Runtime.evaluate", expression=probe,
                       returnByValue=True).get("result", {}).get("value"):
                seen = time.perf_counter() - t0
                break
            time.sleep(0.05)
        time.sleep(1)  # let the page settle before reading its memory
        heap = {m["name"]: m["value"] for m in dt.call("Performance.getMetrics")["metrics"]}
        tab = 0
        for p in tree(proc.pid):
            try:
                with open(f"/proc/{p}/cmdline") as fh:
                    if "--type=renderer" in fh.read():
                        tab = max(tab, hwm_kb(p))
            except OSError:
                pass
        return {"page": seen, "tab_mb": tab / 1024,
                "js_heap_mb": heap.get("JSHeapUsedSize", 0) / 1e6}
    finally:
        stop(proc)
        shutil.rmtree(prof, ignore_errors=True)


def serve_and_browse(a, cmd, port, url_path):
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        if port is None:
            port = int(proc.stdout.readline().strip().rsplit(":", 1)[1])
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        if not wait_port(port, time.time() + 120):
            raise RuntimeError(f"{cmd}: not listening")
        return browser_look(a.browser, f"http://127.0.0.1:{port}{url_path}", "repeat the word",
                            a.work)
    finally:
        stop(proc)


# ---------------------------------------------------------------- one first look

def first_look(kind, cmd, port, python, env=None):
    """Start the server, time listen, run the client in its own process, return the figures."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    watch = RssWatch(proc.pid)
    try:
        if port is None:  # evalflow: --addr 127.0.0.1:0, the first line names the port
            line = proc.stdout.readline()
            if "listening on" not in line:
                raise RuntimeError(f"{cmd}: {line}")
            port = int(line.strip().rsplit(":", 1)[1])
        if not wait_port(port, time.time() + 120):
            raise RuntimeError(f"{cmd}: not listening")
        listen = time.perf_counter() - t0
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain its output
        out = subprocess.run([python, os.path.abspath(__file__), "--client", kind,
                              "--port", str(port)], capture_output=True, text=True,
                             timeout=3600)
        if out.returncode != 0:
            raise RuntimeError(f"client {kind}: {out.stderr[-2000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["listen"] = listen
    finally:
        r_rss, nproc = watch.done()
        stop(proc)
    r["server_rss_mb"] = r_rss
    r["server_procs"] = nproc
    return r


# ---------------------------------------------------------------- the data

def make_log(a, n):
    d = os.path.join(a.work, f"logs-{n}")
    meta = os.path.join(a.work, f"gen-{n}.json")

    def complete():
        logs = [f for f in os.listdir(d) if f.endswith(".eval")] if os.path.isdir(d) else []
        for f in logs:
            try:
                with zipfile.ZipFile(os.path.join(d, f)) as z:
                    if "header.json" in z.namelist():
                        return os.path.join(d, f)
            except zipfile.BadZipFile:
                pass
        return None

    log = complete()
    if log and os.path.exists(meta):
        with open(meta) as fh:
            return log, json.load(fh)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    task = os.path.join(a.work, "task.py")
    with open(task, "w") as fh:
        fh.write(TASK)
    cmd = [os.path.join(a.inspect_venv, "bin", "inspect"), "eval", f"{task}@peer", "-T",
           f"n={n}", "--model", "mockllm/model", "--log-format", "eval", "--log-dir", d,
           "--display", "none", "--no-log-realtime"]
    print(f"  inspect eval n={n} ...", flush=True)
    t = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=a.eval_timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        return None, {"eval_s": time.time() - t, "error": f"timed out after {a.eval_timeout} s"}
    info = {"eval_s": time.time() - t}
    log = complete()
    if proc.returncode != 0 or not log:
        info["error"] = f"inspect eval exited {proc.returncode}: {err[-500:]}"
        return None, info
    info["log_mb"] = os.path.getsize(log) / 1e6
    with open(meta, "w") as fh:
        json.dump(info, fh)
    return log, info


def make_run(a, n, log):
    parent = os.path.join(a.work, f"runs-{n}")
    root = os.path.join(parent, f"inspect-{n}")
    shutil.rmtree(parent, ignore_errors=True)
    os.makedirs(parent)
    t = time.time()
    subprocess.run([a.bin, "import", log, "--out", root], check=True,
                   stdout=subprocess.DEVNULL)
    imp = time.time() - t
    t = time.time()
    v = subprocess.run([a.bin, "validate", os.path.join(root, "import.toml"), "--out", root],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    val = time.time() - t if v.returncode == 0 else None
    return parent, {"import_s": imp, "validate_s": val, "run_mb": du_mb(root)}


# ---------------------------------------------------------------- main

def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--inspect-venv", default="/tmp/peer-venv")
    p.add_argument("--bin", default="target/release/evalflow")
    p.add_argument("--sizes", default="10000,100000")
    p.add_argument("--work", default="/tmp/peer-work")
    p.add_argument("--reps", type=int, default=1, help="fresh servers per tool; medians shown")
    p.add_argument("--eval-timeout", type=float, default=3600,
                   help="seconds `inspect eval` may take to write one log")
    p.add_argument("--browser", help="a Chromium binary: also time the viewer's own page")
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.client:
        return client_main(a.client, a.port)
    a.bin = os.path.abspath(a.bin)
    a.work = os.path.abspath(a.work)
    os.makedirs(a.work, exist_ok=True)
    vpy = os.path.join(a.inspect_venv, "bin", "python")
    ver = subprocess.run([vpy, "-c", "import inspect_ai; print(inspect_ai.__version__)"],
                         capture_output=True, text=True).stdout.strip()
    print(f"inspect_ai {ver}; evalflow {a.bin}", flush=True)
    rows, notes = [], []
    for n in [int(s) for s in a.sizes.split(",")]:
        log, gen = make_log(a, n)
        if not log:
            notes.append(f"{n}: inspect eval failed: {gen.get('error')} ({gen['eval_s']:.0f} s)")
            print("  " + notes[-1], flush=True)
            continue
        print(f"  {n}: log {gen['log_mb']:.1f} MB (inspect eval {gen['eval_s']:.0f} s)",
              flush=True)
        parent, run = make_run(a, n, log)
        val = "failed" if run["validate_s"] is None else f"{run['validate_s']:.2f} s"
        print(f"  {n}: import {run['import_s']:.2f} s, validate {val}, "
              f"run {run['run_mb']:.1f} MB", flush=True)
        for kind in ["inspect", "evalflow"]:
            reps = []
            for _ in range(a.reps):
                if kind == "inspect":
                    port = free_port()
                    cmd = [os.path.join(a.inspect_venv, "bin", "inspect"), "view",
                           "--log-dir", os.path.dirname(log), "--port", str(port)]
                    reps.append(first_look(kind, cmd, port, vpy))
                else:
                    cmd = [a.bin, "view", parent, "--addr", "127.0.0.1:0"]
                    reps.append(first_look(kind, cmd, None, sys.executable))
            r = dict(reps[-1])
            for k in ["listen", "list", "open", "one", "server_rss_mb", "client_rss_mb"]:
                r[k] = statistics.median(x[k] for x in reps)
            if a.browser:
                if kind == "inspect":
                    port = free_port()
                    cmd = [os.path.join(a.inspect_venv, "bin", "inspect"), "view",
                           "--log-dir", os.path.dirname(log), "--port", str(port)]
                    path = "/#/logs/" + urllib.parse.quote(os.path.basename(log))
                else:
                    port, path = None, f"/runs/inspect-{n}/answers"
                    cmd = [a.bin, "view", parent, "--addr", "127.0.0.1:0"]
                r.update(serve_and_browse(a, cmd, port, path))
            r["data"] = (f"{gen['log_mb']:.1f} MB .eval" if kind == "inspect"
                         else f"{run['run_mb']:.1f} MB run")
            r["prep"] = (f"eval {gen['eval_s']:.0f}s" if kind == "inspect" else
                         f"import {run['import_s']:.1f}s"
                         + ("" if run["validate_s"] is None else f"+val {run['validate_s']:.1f}s"))
            rows.append((n, kind, r))
            print(f"  {n} {kind}: {json.dumps(r)}", flush=True)
            notes.append(f"{n} {kind}: list: {r['list_detail']}; open read "
                         f"{r['open_bytes'] / 1e6:.1f} MB for {r['samples']} samples; one: "
                         f"{r['one_detail']}; search: {r['search_detail']}")
    hdr = ("size", "tool", "data", "prepare", "listen s", "list s", "open s", "one s",
           "search s hit/miss", "server RSS MB", "client RSS MB") + (
               ("page s", "tab MB", "JS heap MB") if a.browser else ())
    table = [hdr] + [(f"{n:,}", k, r["data"], r["prep"], f"{r['listen']:.2f}",
                      f"{r['list']:.3f}", f"{r['open']:.3f}", f"{r['one']:.3f}", r["search"],
                      f"{r['server_rss_mb']:.0f}", f"{r['client_rss_mb']:.0f}") + (
                         (f"{r['page']:.2f}" if r["page"] is not None else "never",
                          f"{r['tab_mb']:.0f}", f"{r['js_heap_mb']:.0f}") if a.browser else ())
                     for n, k, r in rows]
    w = [max(len(row[i]) for row in table) for i in range(len(hdr))]
    print()
    for row in table:
        print("  ".join(c.rjust(w[i]) if i > 3 else c.ljust(w[i]) for i, c in enumerate(row)))
    print("(search 'c' = in the client, over loaded summaries; Inspect has no server search)")
    if a.browser:
        print("(page: headless Chromium, navigation -> a sample's input on screen, fresh server)")
    for line in notes:
        print("- " + line)


if __name__ == "__main__":
    main()
