#!/usr/bin/env python3
"""A fault-injecting HTTP proxy in front of an S3-compatible server (moto), for the tests and
benches of a flaky object store (issue 60, item 3).

Each request, with probability --rate, meets one fault drawn from --kinds:
  503    S3's 503 SlowDown, the request not forwarded
  500    500 InternalError, not forwarded
  reset  the connection closed with no answer, not forwarded
  slow   forwarded after --slow seconds
  lost   forwarded (the store commits it), then the connection closed with no answer: the
         client never learns that its request succeeded, the case a retry must survive
Requests whose path or query does not contain --only (default: every request) pass untouched.
GET /__faults answers the counts so far as JSON ({"requests": N, "503": n, ...}).

    python3 tests/fault_proxy.py --upstream http://127.0.0.1:5000 --port 5001 --rate 0.05
"""
import argparse
import http.client
import json
import random
import socket
import struct
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
       "proxy-connection", "content-length"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--rate", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kinds", default="503,500,reset,slow,lost")
    ap.add_argument("--slow", type=float, default=0.5)
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    up = urllib.parse.urlsplit(a.upstream)
    kinds = [k for k in a.kinds.split(",") if k]
    rng = random.Random(a.seed)
    lock = threading.Lock()
    counts = {"requests": 0, **{k: 0 for k in kinds}}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _drop(self):
            # RST rather than FIN: what a load balancer's reset looks like to the client.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                       struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()

        def _answer(self, status, body, headers=()):
            self.send_response(status)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _handle(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else b""
            if self.path == "/__faults":
                with lock:
                    out = json.dumps(counts).encode()
                return self._answer(200, out, [("Content-Type", "application/json")])
            fault = None
            with lock:
                counts["requests"] += 1
                if (not a.only or a.only in self.path) and kinds and rng.random() < a.rate:
                    fault = rng.choice(kinds)
                    counts[fault] += 1
            if fault in ("503", "500"):
                code = "SlowDown" if fault == "503" else "InternalError"
                xml = (f"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code>"
                       f"<Message>injected</Message></Error>").encode()
                return self._answer(int(fault), xml, [("Content-Type", "application/xml")])
            if fault == "reset":
                return self._drop()
            if fault == "slow":
                time.sleep(a.slow)
            c = http.client.HTTPConnection(up.hostname, up.port, timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
            if body or self.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            c.request(self.command, self.path, body=body, headers=headers)
            r = c.getresponse()
            data = r.read()
            c.close()
            if fault == "lost":
                return self._drop()
            hdrs = [(k, v) for k, v in r.getheaders() if k.lower() not in HOP]
            self.send_response(r.status)
            for k, v in hdrs:
                self.send_header(k, v)
            if self.command == "HEAD":
                self.send_header("Content-Length", r.getheader("Content-Length") or "0")
                self.end_headers()
            else:
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    srv = ThreadingHTTPServer(("127.0.0.1", a.port), Handler)
    srv.daemon_threads = True
    print(f"fault proxy on 127.0.0.1:{a.port} -> {a.upstream}", file=sys.stderr, flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
