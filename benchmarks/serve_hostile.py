"""Hostile clients against ``attnmt serve`` on 127.0.0.1: each kind of abuse a service on an open port meets, with
what the server answered, how long it took, the server's memory after it and the slowest ``/health`` answer
while it ran (a monitor asks every 50 ms).

    python benchmarks/serve_hostile.py --path CKPT [--source CHECKOUT] [--only NAME,...] [-- SERVE OPTIONS]

``--source``: run the service of another checkout of attnmt (e.g. a ``git worktree`` of an earlier commit, with
``attnmt/cli`` linked to its ``cli/``), so that the same script measures a build before and after a change. Every
case is bounded in time and size and talks to 127.0.0.1 only. The cases:

* ``alignment``: 8 sentences of 1,023 tokens asking for the attention weights;
* ``vanished``: the same 8 sentences from a client that closes its socket 50 ms after sending, then one short
  request (its latency: whether the vanished client's work still ran);
* ``behind-long``: 16 clients of another address (127.0.0.2) sending 4 such sentences each, then one short request;
* ``idle-connections``: 300 connections that send nothing (the server's open files after 12 s);
* ``slow-headers`` / ``slow-body``: a request's head, or its body, one line or byte a second (seconds until the
  server closed it, at most 40);
* ``huge-header``: a 16 MB header;
* ``many-words`` / ``nfkc``: a 1 MB sentence of 524,000 words; 340,000 x U+FDFA (NFKC makes 18 characters of each);
* ``malformed``: 100,000-deep JSON, a 5,000-digit ``nbest``, ``nbest: "²"``, a form's ``alternatives=--1``, a lone
  surrogate, a body cut off by a disconnect; the statuses, and the 500s the server counted;
* ``echo``: a 900 KB language field (the size of the error answer);
* ``cross-site``: ``Host: evil.example``, a form content type with a JSON body, ``Origin: http://evil.example``, an
  OPTIONS preflight;
* ``disclosure``: the page's security headers, the server banner, what ``/health`` tells, whether ``/metrics`` is open;
* ``shutdown``: SIGTERM with a client trickling its body, at ``--graceful-timeout 0`` and at the default (seconds
  until the process exited, at most 40).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

LONG = " ".join(["word"] * 511)  # 1,023 tokens with the Multi30k recipe's SentencePiece model
SHORT = "A man is riding a bike."


class Server:
    def __init__(self, ckpt: str, source: str | None, options: list[str]):
        env = dict(os.environ)
        if source:
            env["PYTHONPATH"] = source + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen([sys.executable, "-m", "attnmt.cli", "serve", "--path", ckpt, "--port", "0",
                                      "--threads", "1", *options], stderr=subprocess.PIPE, text=True, env=env,
                                     cwd=source or None)
        self.port = None
        for line in self.proc.stderr:
            m = re.search(r"on http://127\.0\.0\.1:(\d+) ", line)
            if m:
                self.port = int(m.group(1))
                break
        if self.port is None:
            raise SystemExit("the service did not start")
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()
        self.worst, self.lock = 0.0, threading.Lock()
        self.monitoring = True
        threading.Thread(target=self._monitor, daemon=True).start()

    def _monitor(self):
        while self.monitoring and self.proc.poll() is None:
            t0 = time.perf_counter()
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                c.request("GET", "/health")
                c.getresponse().read()
                c.close()
            except OSError:
                pass
            with self.lock:
                self.worst = max(self.worst, time.perf_counter() - t0)
            time.sleep(0.05)

    def take_worst(self) -> float:
        with self.lock:
            w, self.worst = self.worst, 0.0
        return w

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kb / 1024

    def open_files(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self, timeout: float = 40) -> float:
        self.monitoring = False
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return float("inf")
        return time.monotonic() - t0


def request(port: int, path: str, body: bytes | None, kind: str = "application/json", headers: dict | None = None,
            method: str = "POST", timeout: float = 120, source: str | None = None) -> tuple[int, int, float]:
    """(status, answer bytes, seconds); status 0: no answer. ``source``: the client's address (127.0.0.x)."""
    t0 = time.perf_counter()
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout,
                                       source_address=(source, 0) if source else None)
        h = {"Content-Type": kind, **(headers or {})} if body is not None else dict(headers or {})
        c.request(method, path, body=body, headers=h)
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, len(data), time.perf_counter() - t0
    except OSError:
        return 0, 0, time.perf_counter() - t0


def jbody(obj) -> bytes:
    return json.dumps(obj).encode()


def seconds_until_closed(sock: socket.socket, feed: bytes, every: float, limit: float) -> float:
    """Send ``feed`` one unit (line or byte) every ``every`` seconds until the server closes: the seconds it took."""
    units = feed.split(b"\n") if b"\n" in feed else [bytes([b]) for b in feed]
    t0 = time.monotonic()
    sock.settimeout(every)
    for unit in units * 100:
        if time.monotonic() - t0 > limit:
            return float("inf")
        try:
            sock.sendall(unit + (b"\n" if b"\n" in feed else b""))
            if not sock.recv(65536):
                return time.monotonic() - t0
            return time.monotonic() - t0  # an answer (408, 431, ...) then close
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - t0
    return float("inf")


def case_alignment(s: Server):
    return request(s.port, "/v1/translate", jbody({"text": [LONG] * 8, "alignment": True}))


def case_vanished(s: Server):
    sock = socket.create_connection(("127.0.0.1", s.port))
    data = jbody({"q": [LONG] * 8})
    sock.sendall(b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    time.sleep(0.05)
    sock.close()
    time.sleep(0.2)
    return request(s.port, "/translate", jbody({"q": SHORT}))


def case_behind_long(s: Server):
    threads = [threading.Thread(target=request, args=(s.port, "/translate", jbody({"q": [LONG] * 4})),
                                kwargs={"source": "127.0.0.2"}) for _ in range(16)]  # another client's
    for t in threads:
        t.start()
    time.sleep(0.3)
    out = request(s.port, "/translate", jbody({"q": SHORT}))
    for t in threads:
        t.join()
    return out


def case_idle(s: Server):
    before = s.open_files()
    socks = []
    for _ in range(300):
        try:
            socks.append(socket.create_connection(("127.0.0.1", s.port)))
        except OSError:
            break
    time.sleep(12)
    held = s.open_files() - before
    for sock in socks:
        sock.close()
    return held, 0, 12.0


def case_slow_headers(s: Server):
    sock = socket.create_connection(("127.0.0.1", s.port))
    sock.sendall(b"POST /translate HTTP/1.1\r\n")
    took = seconds_until_closed(sock, b"\n".join(b"X-Slow-%d: 1\r" % k for k in range(60)), 1.0, 40)
    sock.close()
    return 0, 0, took


def case_slow_body(s: Server):
    sock = socket.create_connection(("127.0.0.1", s.port))
    sock.sendall(b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 200\r\n\r\n")
    took = seconds_until_closed(sock, b'{"q": "' + b"a" * 190 + b'"}', 1.0, 40)
    sock.close()
    return 0, 0, took


def case_huge_header(s: Server):
    """Status 0: the connection was closed (reset) before an answer could be read."""
    t0 = time.perf_counter()
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=60)
    sent, answer = 0, b""
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        while sent < 16 << 20:
            sock.sendall(b"a" * 65536)
            sent += 65536
        sock.sendall(b"\r\nConnection: close\r\n\r\n")
    except OSError:
        pass
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except OSError:
        pass
    sock.close()
    m = re.match(rb"HTTP/1.1 (\d+)", answer)
    return (int(m.group(1)) if m else 0), sent, time.perf_counter() - t0


def case_many_words(s: Server):
    return request(s.port, "/translate", jbody({"q": "a " * 524_000}))


def case_nfkc(s: Server):
    return request(s.port, "/translate", jbody({"q": "\ufdfa" * 340_000}))


def case_malformed(s: Server):
    statuses = []
    for kind, body in (("application/json", b'{"q": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
                       ("application/json", b'{"text": "a", "nbest": ' + b"9" * 5000 + b"}"),
                       ("application/json", '{"text": "a", "nbest": "\u00b2"}'.encode()),
                       ("application/x-www-form-urlencoded", b"q=a&alternatives=--1"),
                       ("application/json", b'{"q": "a \\ud800 b"}')):
        path = "/v1/translate" if b"text" in body else "/translate"
        statuses.append(request(s.port, path, body, kind)[0])
    sock = socket.create_connection(("127.0.0.1", s.port))  # a body cut off by a disconnect
    sock.sendall(b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"q\": ")
    time.sleep(0.2)
    sock.close()
    time.sleep(0.3)
    status, text = metrics(s)
    fives = sum(v for k, v in (text or {}).get("requests_by_status", {}).items() if k.startswith("5"))
    return "/".join(map(str, statuses)), fives, 0.0


def metrics(s: Server):
    c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
    c.request("GET", "/metrics?format=json")
    r = c.getresponse()
    data = r.read()
    try:
        return r.status, json.loads(data)
    except ValueError:
        return r.status, None


def case_echo(s: Server):
    return request(s.port, "/translate", jbody({"q": "a", "source": "x" * 900_000}))


def case_cross_site(s: Server):
    out = [request(s.port, "/translate", jbody({"q": SHORT}), headers={"Host": "evil.example"})[0],
           request(s.port, "/translate", jbody({"q": SHORT}), kind="application/x-www-form-urlencoded")[0],
           request(s.port, "/translate", jbody({"q": SHORT}), headers={"Origin": "http://evil.example"})[0],
           request(s.port, "/translate", None, method="OPTIONS",
                   headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})[0]]
    return "/".join(map(str, out)), 0, 0.0


def case_disclosure(s: Server):
    c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
    c.request("GET", "/")
    r = c.getresponse()
    r.read()
    names = {k.lower() for k, _ in r.getheaders()}
    c.request("GET", "/health")
    health = json.loads(c.getresponse().read())
    flags = [f"csp={'content-security-policy' in names}", f"nosniff={'x-content-type-options' in names}",
             f"server-banner={'server' in names}", f"health-fields={len(health)}",
             f"metrics={metrics(s)[0]}"]
    return " ".join(flags), 0, 0.0


CASES = {"alignment": case_alignment, "vanished": case_vanished, "behind-long": case_behind_long,
         "idle-connections": case_idle, "slow-headers": case_slow_headers, "slow-body": case_slow_body,
         "huge-header": case_huge_header, "many-words": case_many_words, "nfkc": case_nfkc,
         "malformed": case_malformed, "echo": case_echo, "cross-site": case_cross_site,
         "disclosure": case_disclosure}


def shutdown_case(ckpt: str, source: str | None, options: list[str], grace: list[str]) -> float:
    s = Server(ckpt, source, options + grace)
    sock = socket.create_connection(("127.0.0.1", s.port))
    sock.sendall(b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 200\r\n\r\n")
    stop = threading.Event()

    def trickle():  # its body, a byte a second
        for _ in range(100):
            if stop.wait(1.0):
                return
            try:
                sock.sendall(b" ")
            except OSError:
                return

    threading.Thread(target=trickle, daemon=True).start()
    time.sleep(0.5)
    took = s.stop(40)
    stop.set()
    sock.close()
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", required=True, help="the checkpoint to serve")
    ap.add_argument("--source", help="a checkout of attnmt whose service to run (default: this one)")
    ap.add_argument("--only", default="", help="comma-separated case names (default: all, and shutdown)")
    ap.add_argument("serve_options", nargs="*", help="after --: options for attnmt serve")
    args = ap.parse_args()
    source = str(Path(args.source).resolve()) if args.source else None
    only = [c for c in args.only.split(",") if c]
    print(f"{'case':<18} {'status':>22} {'bytes':>10} {'seconds':>8} {'RSS MiB':>8} {'worst /health s':>15}")
    s = Server(args.path, source, args.serve_options)
    try:
        for name, case in CASES.items():
            if only and name not in only:
                continue
            s.take_worst()
            status, size, seconds = case(s)
            print(f"{name:<18} {status!s:>22} {size:>10} {seconds:>8.2f} {s.rss_mib():>8.0f} {s.take_worst():>15.2f}",
                  flush=True)
    finally:
        s.stop()
    if not only or "shutdown" in only:
        for label, grace in (("grace 0", ["--graceful-timeout", "0"]), ("default grace", [])):
            took = shutdown_case(args.path, source, args.serve_options, grace)
            print(f"{'shutdown ' + label:<18} {'':>22} {'':>10} {took:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
