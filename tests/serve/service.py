"""A running ``attnmt serve`` for the service tests: started on a free port, stopped with SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path


class Service:
    def __init__(self, ckpt: Path, *options: str):
        self.ckpt = ckpt
        self.proc = subprocess.Popen([sys.executable, "-m", "attnmt.cli", "serve", "--path", str(ckpt), "--port", "0",
                                      "--threads", "1", *options], stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.url = None
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.lines.append(line.rstrip("\n"))
                m = re.search(r"on (http://\S+) ", line)
                if m:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(120)
        assert self.url, "\n".join(self.lines)

    def request(self, path: str, body=None, *, raw: bytes | None = None, content_type: str = "application/json",
                method: str | None = None, timeout: float = 60) -> tuple[int, dict | str, dict]:
        """(status, JSON answer or text, headers)."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, text, headers = r.status, r.read().decode(), dict(r.headers)
        except urllib.error.HTTPError as e:
            status, text, headers = e.code, e.read().decode(), dict(e.headers)
        kind = headers.get("content-type", "")
        return status, (json.loads(text) if kind.startswith("application/json") else text), headers

    @staticmethod
    def run_to_end(ckpt: Path, *options: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """``attnmt serve`` with ``options`` that should make it fail before it serves."""
        return subprocess.run([sys.executable, "-m", "attnmt.cli", "serve", "--path", str(ckpt), "--port", "0",
                               *options], capture_output=True, text=True, timeout=timeout)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            time.sleep(0.1)  # the reader thread takes the last lines

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
