"""``attnmt serve`` against hostile and careless clients on a real socket: slow and idle connections are closed,
oversized heads refused, a client that vanishes costs nothing more, other hosts and origins are refused, keys and
rates hold, /metrics is not for everyone, and shutdown ends within its grace."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from helpers import make_checkpoint, sentence_lines
from service import Service


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("hostile"))


def address(s: Service) -> tuple[str, int]:
    host, port = s.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def closed_after(sock: socket.socket, limit: float = 10.0) -> tuple[float, bytes]:
    """(seconds until the server closed ``sock``, what it sent before)."""
    t0, got = time.monotonic(), b""
    sock.settimeout(limit)
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        got += chunk
    return time.monotonic() - t0, got


def raw_request(s: Service, data: bytes, timeout: float = 30) -> bytes:
    with socket.create_connection(address(s), timeout=timeout) as sock:
        sock.sendall(data)
        return closed_after(sock, timeout)[1]


def post(path: str, body: dict, host: str = "127.0.0.1", extra: str = "") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
            f"\r\nConnection: close\r\n{extra}\r\n").encode() + data


@pytest.fixture(scope="module")
def guarded(ckpt):
    s = Service(ckpt, "--max-len-b", "12", "--header-timeout", "1", "--body-timeout", "1", "--max-connections", "8",
                "--max-header-bytes", "4096", "--batch-wait-ms", "1500", "--max-request-bytes", "65536")
    yield s
    assert s.stop() == 0, "\n".join(s.lines)


def test_idle_and_slow_connections_are_closed_at_their_deadlines(guarded):
    host, port = address(guarded)
    idle = socket.create_connection((host, port))
    took, got = closed_after(idle)
    assert 0.8 < took < 3 and got == b""  # a connection that sends nothing
    trickle = socket.create_connection((host, port))
    trickle.sendall(b"POST /translate HTTP/1.1\r\n")
    t0 = time.monotonic()
    try:
        for k in range(20):  # one header line every 0.3 s: the head never completes in time
            time.sleep(0.3)
            trickle.sendall(f"X-Slow-{k}: 1\r\n".encode())
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert time.monotonic() - t0 < 3
    slow_body = socket.create_connection((host, port))
    slow_body.sendall(b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{")
    took, got = closed_after(slow_body)
    assert 0.8 < took < 3 and got.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 1 s" in got
    assert guarded.request("/health")[0] == 200


def test_an_oversized_head_gets_431_and_too_many_connections_are_closed(guarded):
    got = raw_request(guarded, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 8000 + b"\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 431 ")
    held = [socket.create_connection(address(guarded)) for _ in range(8)]
    try:
        extra = socket.create_connection(address(guarded))
        took, got = closed_after(extra, 5)
        assert took < 0.9 and got == b""  # closed at once, not at the header deadline
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    assert guarded.request("/health")[0] == 200


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """(status, body) of one answer on a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), body


def test_a_kept_alive_connection_serves_on_after_an_early_413(guarded):
    """The rest of a refused body is not taken for the next request's headers."""
    with socket.create_connection(address(guarded), timeout=10) as sock:
        big = json.dumps({"q": "a " * 50_000}).encode()
        sock.sendall(b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(big))
        assert read_response(sock)[0] == 413  # from its Content-Length, before the body
        sock.sendall(big)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(sock)[0] == 200


def test_a_client_that_disconnects_is_dropped_and_counted_as_499(guarded):
    before = guarded.request("/metrics?format=json")[1]
    with socket.create_connection(address(guarded)) as sock:  # its job waits 1.5 s for company: still queued
        sock.sendall(post("/translate", {"q": sentence_lines(8, 50)}))
        time.sleep(0.3)
    time.sleep(2.5)
    after = guarded.request("/metrics?format=json")[1]
    assert after["requests_by_status"].get("499", 0) - before["requests_by_status"].get("499", 0) == 1
    assert after["sentences"] == before["sentences"] and after["batches"] == before["batches"]  # never searched
    assert after["queue_sentences"] == 0


def test_other_hosts_and_origins_are_refused_and_allowed_origins_get_cors(ckpt):
    s = Service(ckpt, "--max-len-b", "12", "--cors-origins", "https://app.example")
    try:
        line = sentence_lines(1, 51)[0]
        rebound = raw_request(s, post("/translate", {"q": line}, host="evil.example"))
        assert rebound.startswith(b"HTTP/1.1 400 ") and b"--allowed-hosts" in rebound
        for origin in ("http://evil.example", "null"):
            other = raw_request(s, post("/translate", {"q": line}, extra=f"Origin: {origin}\r\n"))
            assert other.startswith(b"HTTP/1.1 403 ") and b"--cors-origins" in other
        same = raw_request(s, post("/translate", {"q": line}, host=f"127.0.0.1:{address(s)[1]}",
                                   extra=f"Origin: http://127.0.0.1:{address(s)[1]}\r\n"))
        assert same.startswith(b"HTTP/1.1 200 ")  # the service's own page
        allowed = raw_request(s, post("/translate", {"q": line}, extra="Origin: https://app.example\r\n"))
        assert allowed.startswith(b"HTTP/1.1 200 ") and b"access-control-allow-origin: https://app.example" in allowed
        preflight = raw_request(s, b"OPTIONS /translate HTTP/1.1\r\nHost: localhost\r\nOrigin: https://app.example\r\n"
                                   b"Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: "
                                   b"content-type\r\nConnection: close\r\n\r\n")
        assert preflight.startswith(b"HTTP/1.1 200 ") and b"access-control-allow-methods" in preflight
    finally:
        assert s.stop() == 0


def test_api_keys_and_the_request_rate_are_enforced(ckpt, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# the service's keys\nkey-one\nkey-two  # a comment\n")
    s = Service(ckpt, "--max-len-b", "12", "--api-keys", str(keys), "--req-limit", "2", "--metrics-token", "m1")
    try:
        line = sentence_lines(1, 52)[0]
        status, body, _ = s.request("/translate", {"q": line})
        assert status == 401 and "API key is required" in body["error"]
        status, body, _ = s.request("/translate", {"q": line, "api_key": "wrong"})
        assert status == 403 and body["error"] == "the API key is not valid"
        assert s.request("/translate", {"q": line, "api_key": "key-one"})[0] == 200
        got = raw_request(s, post("/v1/translate", {"text": line}, extra="Authorization: Bearer key-one\r\n"))
        assert got.startswith(b"HTTP/1.1 200 ")
        status, body, headers = s.request("/translate", {"q": line, "api_key": "key-one"})
        assert status == 429 and int(headers["retry-after"]) >= 1 and "over 2 requests a minute" in body["error"]
        assert s.request("/translate", {"q": line, "api_key": "key-two"})[0] == 200  # a rate per key
        status, body, _ = s.request("/metrics")
        assert status == 401 and "--metrics-token" in body["error"]
        got = raw_request(s, b"GET /metrics?format=json HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer m1\r\n"
                             b"Connection: close\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 200 ") and b'"429":1' in got.replace(b" ", b"")
    finally:
        assert s.stop() == 0
    bad = Service.run_to_end(ckpt, "--api-keys", str(tmp_path / "missing.txt"))
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "--api-keys" in bad.stderr


def test_alignment_is_refused_unless_the_operator_allows_it(ckpt):
    s = Service(ckpt, "--max-len-b", "12")
    try:
        status, body, _ = s.request("/v1/translate", {"text": "a b", "alignment": True})
        assert status == 403 and "--allow-alignment" in body["error"]
        assert s.request("/health")[1]["alignment"] is False
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("second_signal", [False, True])
def test_shutdown_ends_within_its_grace_and_unfinished_requests_get_503(ckpt, second_signal):
    grace = "30" if second_signal else "0"
    s = Service(ckpt, "--max-len-b", "12", "--batch-wait-ms", "20000", "--graceful-timeout", grace)
    got = {}
    waiting = threading.Thread(target=lambda: got.update(answer=s.request("/translate", {"q": "a b c"})))
    waiting.start()
    trickler = socket.create_connection(address(s))  # a client in the middle of its headers
    trickler.sendall(b"POST /translate HTTP/1.1\r\n")
    time.sleep(0.5)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    if second_signal:
        time.sleep(0.5)
        s.proc.send_signal(signal.SIGTERM)
    code = s.proc.wait(15)
    took = time.monotonic() - t0
    waiting.join(15)
    trickler.close()
    assert code == 0 and took < 4, (took, "\n".join(s.lines))
    if not second_signal:  # answered before the server went
        assert got["answer"][0] == 503 and "stopped before this translation finished" in got["answer"][1]["error"]


def test_an_unexpected_error_is_logged_with_its_traceback_and_answered_with_a_generic_500(caplog):
    import asyncio

    from attnmt.serve.app import create_app

    class Model:  # what the routes ask of a translator before the failing step
        source_lang, target_lang = "en", "de"

        def max_source_tokens(self):
            return 100

    app = create_app(Model())
    svc = app.state.service

    def broken(value, name):
        raise RuntimeError("secret internal detail")

    svc.sentences = broken
    body = json.dumps({"q": "a"}).encode()
    sent = []

    async def call():
        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/translate", "raw_path": b"/translate",
                 "query_string": b"", "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 5000), "scheme": "http",
                 "http_version": "1.1", "root_path": "", "app": app}
        await app(scope, receive, send)

    with caplog.at_level("ERROR", logger="attnmt.serve"):
        asyncio.run(call())
    assert sent[0]["status"] == 500
    answer = json.loads(sent[1]["body"])
    assert answer == {"error": "internal error; the service's log has the details"}  # nothing of the exception
    assert "secret internal detail" in caplog.text and "Traceback" in caplog.text
