"""``attnmt serve``: a trained model behind an HTTP/JSON service and a page (``pip install 'attnmt[serve]'``).

``app.py`` has the routes and request checks, ``batcher.py`` the dynamic batching of concurrent requests on one
decoding thread, ``metrics.py`` the counters; :func:`serve` runs the application with uvicorn until SIGTERM or
Ctrl-C, then finishes the requests in flight and the queued work before it returns.
"""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable
from contextlib import contextmanager

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


def serve(translator, cfg, announce: Callable[[str], None] = print) -> dict:
    """Serve ``translator`` with ``cfg`` (``ServeConfig``) until SIGTERM/SIGINT; what the service counted."""
    import uvicorn

    from attnmt.serve.app import create_app

    app = create_app(translator, cfg)
    sock = listen(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=cfg.graceful_timeout or None)
    server = _make_server(config)
    shown = f"[{host}]" if ":" in host else host
    announce(f"serving {translator.source_lang}->{translator.target_lang} on http://{shown}:{port} "
             f"(POST /translate, /v1/translate; GET / /health /metrics); SIGTERM or Ctrl-C stops")
    server.run(sockets=[sock])
    if server.failed:
        raise UserError("the service could not start (see the lines above)")
    svc = app.state.service
    return {"signal": server.signal_name, **svc.metrics.snapshot(0, svc.batcher.stats)}


def _make_server(config):
    """uvicorn's server with the service's signal policy: the first SIGTERM/SIGINT stops accepting and finishes
    what is in flight, a second Ctrl-C stops at once; the process then ends normally (exit 0), not by the signal."""
    import uvicorn

    class Server(uvicorn.Server):
        signal_name: str | None = None
        failed = False

        @contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            signals = (signal.SIGINT, signal.SIGTERM)
            before = {s: signal.signal(s, self._stop) for s in signals}
            try:
                yield
            finally:
                for s, h in before.items():
                    signal.signal(s, h)

        def _stop(self, signum, frame):
            self.signal_name = signal.Signals(signum).name
            if self.should_exit and signum == signal.SIGINT:  # Ctrl-C twice: stop now
                self.force_exit = True
            self.should_exit = True

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            self.failed = self.should_exit and not self.started

    return Server(config)
