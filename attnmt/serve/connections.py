"""Connection hygiene for uvicorn: deadlines for a request's head and body, a size limit for its head, a bound on
open connections.

uvicorn has a keep-alive timeout but no deadline for a request's head or body and no head-size limit with its
httptools parser: a client that trickles its headers one byte a second, or opens connections and sends nothing,
holds them as long as it likes. :func:`guarded_protocol` makes the protocol class uvicorn runs with these limits:

* a connection must complete a request's head within ``header_timeout`` seconds from the moment it is opened (or
  its previous answer was sent); else it is closed;
* the head (request line and headers) may have at most ``max_header_bytes``; beyond: 431 and closed;
* a request must send its whole body within ``body_timeout`` seconds of its head; else 408 and closed (the
  application sees the client disconnect);
* connections beyond ``max_connections`` are closed as soon as they open;
* when the server stops, a request still sending its body gets 503 at once.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def _raw_response(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": message}).encode("ascii")
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode("ascii") + body


def guarded_protocol(header_timeout: float, body_timeout: float, max_header_bytes: int, max_connections: int,
                     on_refused=lambda status: None) -> type:
    """The httptools protocol class with the limits above; ``on_refused(status)`` counts each connection closed
    by them (0: closed without an answer)."""

    class GuardedProtocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._head_bytes = 0
            self._head_timer = self._body_timer = None
            if len(self.connections) > max_connections:
                on_refused(0)
                transport.close()
                return
            self._await_head()

        def _await_head(self) -> None:
            self._head_bytes = 0
            self._head_timer = self.loop.call_later(header_timeout, self._expire, 0)

        def _stop_timer(self, name: str) -> None:
            timer = getattr(self, name, None)
            if timer is not None:
                timer.cancel()
                setattr(self, name, None)

        def _expire(self, status: int) -> None:
            """A deadline passed: answer ``status`` (0: nothing) unless an answer has begun, and close."""
            self._head_timer = self._body_timer = None
            if self.transport.is_closing():
                return
            on_refused(status)
            if status and (self.cycle is None or not self.cycle.response_started):
                messages = {408: ("Request Timeout", f"the request body did not arrive within {body_timeout:g} s"),
                            431: ("Request Header Fields Too Large",
                                  f"the request's headers are over {max_header_bytes} bytes")}
                reason, message = messages[status]
                self.transport.write(_raw_response(status, reason, message))
                if self.cycle is not None:
                    self.cycle.response_complete = True  # the application's answer, if any, is not sent
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is not None:  # reading a request's head
                end = data.find(b"\r\n\r\n")
                self._head_bytes += len(data) if end < 0 else end
                if self._head_bytes > max_header_bytes:
                    self._stop_timer("_head_timer")
                    self._expire(431)
                    return
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._stop_timer("_head_timer")
            super().on_headers_complete()
            self._body_timer = self.loop.call_later(body_timeout, self._expire, 408)

        def on_message_complete(self) -> None:
            self._stop_timer("_body_timer")
            answered = self.cycle is not None and self.cycle.response_complete  # early, e.g. a 413
            super().on_message_complete()
            if answered:
                self._next_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._body_timer is None:  # else the rest of the body is still coming (on_message_complete)
                self._next_head()

        def _next_head(self) -> None:
            if not self.transport.is_closing() and self._head_timer is None:
                self._await_head()  # the next request's head (uvicorn's keep-alive timeout closes an idle one)

        def shutdown(self) -> None:
            """The server is stopping: a request still sending its body is answered 503 now (it cannot be
            translated any more); the others as uvicorn does (idle connections closed, answers finished)."""
            if self._body_timer is not None and self.cycle is not None and not self.cycle.response_started:
                self._stop_timer("_body_timer")
                on_refused(503)
                self.transport.write(_raw_response(503, "Service Unavailable", "the service is shutting down; "
                                                   "retry on another instance"))
                self.cycle.response_complete = True
                self.transport.close()
                return
            super().shutdown()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer("_head_timer")
            self._stop_timer("_body_timer")
            super().connection_lost(exc)

    return GuardedProtocol
