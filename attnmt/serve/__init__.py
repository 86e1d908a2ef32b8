"""``attnmt serve``: a trained model behind an HTTP/JSON service and a page (``pip install 'attnmt[serve]'``).

``app.py`` has the routes and request checks, ``batcher.py`` the dynamic batching of concurrent requests on one
decoding thread, ``metrics.py`` the counters; :func:`serve` runs the application with uvicorn until SIGTERM or
Ctrl-C, then finishes the requests in flight and the queued work before it returns.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from collections.abc import Callable

from attnmt.errors import UserError


def missing_dependencies() -> str | None:
    """None when the service's libraries are installed; else what to install."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        return f"attnmt serve needs {e.name}: pip install 'attnmt[serve]'"
    return None


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a taken port is a one-line error before anything is served."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(2048)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: cannot resolve it ({e.strerror}); give an address such as 127.0.0.1") \
            from None
    except OSError as e:
        raise UserError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); choose another port "
                        f"(--port 0 picks a free one)") from None
    return sock


def network_warnings(cfg) -> list[str]:
    """What an operator should know about serving on every interface (docs/serving.md, "On a network")."""
    from attnmt.serve.access import is_loopback

    try:
        local = is_loopback(socket.gethostbyname(cfg.host))
    except OSError:
        local = False
    if local:
        return []
    out = []
    if not cfg.api_keys:
        out.append(f"listening on {cfg.host} without --api-keys: anyone who can reach this port may translate")
    if not cfg.allowed_hosts.strip() and cfg.host in ("0.0.0.0", "::", ""):
        out.append("any Host header is accepted; name the service's host names with --allowed-hosts")
    return out


class _QuietCancellation(logging.Filter):
    """Drops uvicorn's report of its lifespan task cancelled: what a second signal does on purpose (it stops at
    once, without the lifespan's end), not a fault."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError):
            return False
        message = str(record.msg)  # starlette hands the lifespan's traceback to uvicorn as a message
        return not (message.startswith("Traceback") and message.rstrip().endswith("CancelledError"))


def serve(translator, cfg, announce: Callable[[str], None] = print) -> dict:
    """Serve ``translator`` with ``cfg`` (``ServeConfig``) until SIGTERM/SIGINT; what the service counted.

    The HTTP server runs on a thread of its own and the decoding loop on the calling (main) thread, which also
    takes the signals: the first SIGTERM or Ctrl-C stops accepting connections, lets the requests in flight finish
    (at most ``graceful_timeout`` seconds; those unfinished then get 503), and returns; a second signal stops at
    once. Connections are bounded as ``connections.py`` says.
    """
    import uvicorn

    from attnmt.serve.app import create_app, make_batcher
    from attnmt.serve.batcher import IDLE_WAKE_SECONDS
    from attnmt.serve.connections import guarded_protocol

    batcher = make_batcher(cfg, thread=False)
    app = create_app(translator, cfg, batcher)
    svc = app.state.service
    sock = listen(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    protocol = guarded_protocol(cfg.header_timeout, cfg.body_timeout, cfg.max_header_bytes, cfg.max_connections,
                                on_refused=lambda status: svc.metrics.request(status) if status else None)
    # uvicorn's own grace is a backstop: the service answers what is in flight by graceful_timeout (503 if
    # unfinished), so uvicorn only waits for those answers to be written
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", http=protocol,
                            timeout_keep_alive=cfg.keep_alive, timeout_graceful_shutdown=cfg.graceful_timeout + 1,
                            server_header=False)
    server = uvicorn.Server(config)
    state: dict = {"signal": None}

    def on_signal(signum, frame):
        state["signal"] = signal.Signals(signum).name
        if server.should_exit:  # a second signal: stop now
            server.force_exit = True
        svc.begin_stop(now=server.should_exit)
        server.should_exit = True

    def run_server():
        try:
            server.run(sockets=[sock])
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            state["error"] = e
        finally:
            # the lifespan's end has stopped it already, unless the server never started or a second signal came
            batcher.stop(drop=server.force_exit)

    quiet = _QuietCancellation()
    logging.getLogger("uvicorn.error").addFilter(quiet)
    before = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=run_server, name="attnmt-http", daemon=True)
    try:
        thread.start()
        shown = f"[{host}]" if ":" in host else host
        announce(f"serving {translator.source_lang}->{translator.target_lang} on http://{shown}:{port} "
                 f"(POST /translate, /v1/translate; GET / /health /metrics); SIGTERM or Ctrl-C stops")
        reason = translator.continuous_unsupported() if cfg.batching == "continuous" else None
        if reason is not None:
            announce(f"continuous batching does not take {reason}: batching statically")
        for line in network_warnings(cfg):
            announce(line)
        batcher.run()
        while thread.is_alive():  # a timed join, so that a second Ctrl-C's handler can run (batcher.IDLE_WAKE_SECONDS)
            thread.join(IDLE_WAKE_SECONDS)
    finally:
        for s, h in before.items():
            signal.signal(s, h)
        logging.getLogger("uvicorn.error").removeFilter(quiet)
    if "error" in state or not server.started:
        raise UserError(f"the service stopped: {state.get('error') or 'it could not start (see above)'}")
    return {"signal": state["signal"], **svc.metrics.snapshot(0, batcher.stats)}
