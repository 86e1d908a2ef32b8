"""Load on ``attnmt serve``: N concurrent clients sending one sentence per request, against ``attnmt translate``.

    python benchmarks/serve_load.py --path CKPT --input ../shared/data/multi30k/test_2016_flickr.en.gz \
        --clients 1,8,32 --seconds 20 --malformed 1000 [-- OPTIONS FOR BOTH, e.g. --lenpen 1.0]

Starts the service on a free local port (``attnmt serve --port 0``), then per concurrency level runs the clients
for ``--seconds`` (after a short warm-up): each sends the input's sentences in turn to LibreTranslate's
``/translate`` over a kept-alive connection and waits for the answer. Prints sentences/s, latency percentiles and
failed requests per level, next to ``attnmt translate``'s rate on the same sentences and options (the marginal
rate: the whole file minus a one-line run, so that loading the model is not counted; measured before and after
the service, as the machine's speed drifts). ``--rounds R`` repeats the levels R times with translate measured
between rounds, each level of a round compared with the translate runs just before and after it, and reports
per level the median of the rounds (and every round's ratio): the drift of a shared machine then moves both sides
of a ratio alike. ``--malformed N`` sends N malformed requests of many kinds from extra clients during the last
level of the last round and counts their 4xx answers.
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

MALFORMED = [  # (method, path, content type, body)
    ("POST", "/translate", "application/json", b"{q: 1"),
    ("POST", "/translate", "application/json", b'{"q": "\xff\xfe"}'),
    ("POST", "/translate", "application/json", b""),
    ("POST", "/translate", "application/json", b'["a"]'),
    ("POST", "/translate", "application/json", b'{"source": "en"}'),
    ("POST", "/translate", "application/json", b'{"q": ""}'),
    ("POST", "/translate", "application/json", b'{"q": 5}'),
    ("POST", "/translate", "application/json", b'{"q": []}'),
    ("POST", "/translate", "application/json", json.dumps({"q": ["a"] * 500}).encode()),
    ("POST", "/translate", "application/json", json.dumps({"q": "word " * 2000}).encode()),
    ("POST", "/translate", "application/json", b'{"q": "a", "target": "xx"}'),
    ("POST", "/translate", "application/json", b'{"q": "a", "format": "html"}'),
    ("POST", "/translate", "application/json", b'{"q": "a", "alternatives": 99}'),
    ("POST", "/translate", "application/xml", b"<q>a</q>"),
    ("GET", "/translate", "", b""),
    ("POST", "/nope", "application/json", b"{}"),
    ("POST", "/v1/translate", "application/json", b'{"text": "a", "nbest": 0}'),
    ("POST", "/translate", "application/json", b'{"q": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("POST", "/v1/translate", "application/json", b'{"text": "a", "nbest": ' + b"9" * 5000 + b"}"),
    ("POST", "/v1/translate", "application/json", '{"text": "a", "nbest": "\u00b2"}'.encode()),
    ("POST", "/translate", "application/x-www-form-urlencoded", b"q=a&alternatives=--1"),
    ("POST", "/translate", "application/json", b'{"q": "a \\ud800 b"}'),
    ("POST", "/translate", "application/x-www-form-urlencoded", b'{"q": "a"}'),
    ("POST", "/translate", "application/json", json.dumps({"q": "a", "source": "x" * 900_000}).encode()),
    ("POST", "/translate", "application/json", json.dumps({"q": "\ufdfa" * 340_000}).encode()),
]


def start_service(path: str, options: list[str]) -> tuple[subprocess.Popen, str, int]:
    proc = subprocess.Popen([sys.executable, "-m", "attnmt.cli", "serve", "--path", path, "--port", "0",
                             "--max-queue", "100000", *options], stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        m = re.search(r"on http://([^:]+):(\d+) ", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, m.group(1), int(m.group(2))
    raise SystemExit(f"attnmt serve did not start (exit {proc.wait()})")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[max(0, min(len(v) - 1, int(round(q * len(v) + 0.5)) - 1))]


class Client(threading.Thread):
    def __init__(self, host: str, port: int, sentences: list[str], start: int, stop_at: float, count_from: float):
        super().__init__(daemon=True)
        self.conn = http.client.HTTPConnection(host, port, timeout=120)
        self.sentences, self.at, self.stop_at, self.count_from = sentences, start, stop_at, count_from
        self.done, self.failed, self.latencies = 0, 0, []

    def run(self):
        while time.perf_counter() < self.stop_at:
            q = self.sentences[self.at % len(self.sentences)]
            self.at += 1
            t0 = time.perf_counter()
            try:
                self.conn.request("POST", "/translate", json.dumps({"q": q, "source": "auto"}),
                                  {"Content-Type": "application/json"})
                r = self.conn.getresponse()
                body = r.read()
                ok = r.status == 200 and "translatedText" in json.loads(body)
            except (OSError, http.client.HTTPException, ValueError):
                ok = False
                self.conn.close()
            t1 = time.perf_counter()
            if t0 >= self.count_from and t1 <= self.stop_at:
                if ok:
                    self.done += 1
                    self.latencies.append(t1 - t0)
                else:
                    self.failed += 1


class Malformed(threading.Thread):
    def __init__(self, host: str, port: int, count: int, offset: int):
        super().__init__(daemon=True)
        self.host, self.port, self.count, self.offset = host, port, count, offset
        self.status: dict[int, int] = {}

    def run(self):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        for k in range(self.count):
            method, path, kind, body = MALFORMED[(self.offset + k) % len(MALFORMED)]
            try:
                conn.request(method, path, body if method == "POST" else None,
                             {"Content-Type": kind} if kind else {})
                r = conn.getresponse()
                r.read()
                self.status[r.status] = self.status.get(r.status, 0) + 1
            except (OSError, http.client.HTTPException):
                self.status[0] = self.status.get(0, 0) + 1
                conn.close()
                conn = http.client.HTTPConnection(self.host, self.port, timeout=120)


def translate_seconds(path: str, lines: list[str], options: list[str]) -> float:
    """Wall seconds of one ``attnmt translate`` process over ``lines``."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "attnmt.cli", "translate", "--path", path, *options],
                   input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
    return time.perf_counter() - t0


def translate_rate(path: str, sentences: list[str], options: list[str]) -> float:
    """``attnmt translate``'s marginal sentences/s over the whole input (a one-line run subtracted: no loading)."""
    one = translate_seconds(path, sentences[:1], options)
    return (len(sentences) - 1) / (translate_seconds(path, sentences, options) - one)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", required=True)
    ap.add_argument("--input", required=True, help="source sentences, one per line (.gz too)")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--malformed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="repeat the levels, translate measured between rounds")
    ap.add_argument("--serve-args", default="", help="options for attnmt serve only, e.g. '--batch-wait-ms 20'")
    ap.add_argument("--json", help="write the results here as well")
    args, options = ap.parse_known_args()
    options = [o for o in options if o != "--"]
    opener = gzip.open if args.input.endswith(".gz") else open
    with opener(args.input, "rt", encoding="utf-8") as f:
        sentences = [s.strip() for s in f if s.strip()]

    # the machine's speed drifts between minutes: translate is measured before the first round, between rounds and
    # after the last; each round's levels are compared with the mean of the runs just before and after them
    translate_seconds(args.path, sentences[:1], options)  # warm-up: the first process starts cold (caches)
    yard = [translate_rate(args.path, sentences, options)]
    print(f"attnmt translate: {yard[0]:.1f} sentences/s ({len(sentences)} sentences, loading excluded)", flush=True)
    proc, host, port = start_service(args.path, options + args.serve_args.split())
    levels = [int(c) for c in args.clients.split(",")]
    rows: list[dict] = []
    alive, code = False, None
    try:
        def stats() -> dict:
            conn = http.client.HTTPConnection(host, port, timeout=30)
            conn.request("GET", "/metrics?format=json")
            return json.loads(conn.getresponse().read())

        for rnd in range(args.rounds):
            for n in levels:
                malformed = args.malformed if (rnd == args.rounds - 1 and n == levels[-1]) else 0
                row = run_level(host, port, sentences, n, args.warmup, args.seconds, malformed, stats)
                row["round"] = rnd
                rows.append(row)
                print(json.dumps(row), flush=True)
            if rnd < args.rounds - 1:
                yard.append(translate_rate(args.path, sentences, options))
                print(f"attnmt translate: {yard[-1]:.1f} sentences/s", flush=True)
        conn = http.client.HTTPConnection(host, port, timeout=30)
        conn.request("GET", "/health")
        alive = conn.getresponse().status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    yard.append(translate_rate(args.path, sentences, options))
    print(f"attnmt translate: {yard[-1]:.1f} sentences/s", flush=True)
    for r in rows:
        r["translate"] = (yard[r["round"]] + yard[r["round"] + 1]) / 2
        r["vs_translate"] = r["sentences_per_s"] / r["translate"]
    print(f"\nservice alive at the end: {alive}; exit code after SIGTERM: {code}\n")
    print("| clients | sentences/s | vs `attnmt translate` | p50 ms | p95 ms | p99 ms | failed | sentences per "
          "search step (continuous) or call (static) | decoder busy |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| `attnmt translate` ({', '.join(f'{y:.1f}' for y in yard)}) | {statistics.median(yard):.1f} | 1.00 "
          f"| | | | | | |")
    for n in levels:
        rs = [r for r in rows if r["clients"] == n]
        med = {k: statistics.median(r[k] for r in rs) for k in ("sentences_per_s", "vs_translate", "p50_ms",
                                                                 "p95_ms", "p99_ms", "mean_batch", "decoder_busy")}
        each = ", ".join(f"{r['vs_translate']:.2f}" for r in rs)
        ratios = "" if len(rs) == 1 else f" ({each})"
        print(f"| {n} | {med['sentences_per_s']:.1f} | {med['vs_translate']:.2f}{ratios} | {med['p50_ms']:.0f} | "
              f"{med['p95_ms']:.0f} | {med['p99_ms']:.0f} | {sum(r['failed'] for r in rs)} | "
              f"{med['mean_batch']:.1f} | {100 * med['decoder_busy']:.0f}% |")
    if len(rows) > len(levels):
        print("\n(medians over the rounds; the ratios in brackets are each round's, against the translate runs just "
              "before and after it; failed: summed)")
    for r in rows:
        if "malformed" in r:
            print(f"\nmalformed requests during the {r['clients']}-client run: {r['malformed_4xx']}/{r['malformed']} "
                  f"answered 4xx (by status: {r['malformed_status']})")
    if args.json:
        Path(args.json).write_text(json.dumps({"translate": yard, "rows": rows, "alive": alive, "exit": code},
                                              indent=1))


def run_level(host: str, port: int, sentences: list[str], n: int, warmup: float, seconds: float, malformed: int,
              stats) -> dict:
    """``n`` clients for ``warmup`` + ``seconds`` (and ``malformed`` bad requests from 4 more): the level's row."""
    before = stats()
    t0 = time.perf_counter()
    count_from, stop_at = t0 + warmup, t0 + warmup + seconds
    clients = [Client(host, port, sentences, k * len(sentences) // n, stop_at, count_from) for k in range(n)]
    bad = [Malformed(host, port, malformed // 4 + (k < malformed % 4), k * 5) for k in range(4)] if malformed else []
    for c in clients + bad:
        c.start()
    for c in clients + bad:
        c.join()
    after = stats()
    wall = time.perf_counter() - t0
    batches = max(1, after["batches"] - before["batches"])
    busy = after["decoding_busy_seconds"] - before["decoding_busy_seconds"]
    lat = [x for c in clients for x in c.latencies]
    row = {"clients": n, "sentences_per_s": sum(c.done for c in clients) / seconds,
           "p50_ms": 1000 * percentile(lat, 0.5), "p95_ms": 1000 * percentile(lat, 0.95),
           "p99_ms": 1000 * percentile(lat, 0.99), "failed": sum(c.failed for c in clients),
           "mean_batch": (after["sentences"] - before["sentences"]) / batches, "decoder_busy": busy / wall}
    steps = after.get("search_steps", 0) - before.get("search_steps", 0)
    if steps:  # continuous batching: the sentences each search step decoded
        row["mean_batch"] = (after["search_step_sentences"] - before["search_step_sentences"]) / steps
        row["ms_per_step"] = 1000 * busy / steps
    if bad:
        status: dict[int, int] = {}
        for b in bad:
            for k, v in b.status.items():
                status[k] = status.get(k, 0) + v
        row["malformed"] = malformed
        row["malformed_4xx"] = sum(v for k, v in status.items() if 400 <= k < 500)
        row["malformed_status"] = dict(sorted(status.items()))
    return row


if __name__ == "__main__":
    main()
