"""Bounds on what one connection can make the server hold or wait for, before any request reaches the API.

How it works and why: docs/INTERNALS.md, moe_jax/serving/http_limits.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

WHY = " (--max-request-mb, or the most text a prompt that fits the context can take)"
REASONS = {408: b"Request Timeout", 413: b"Content Too Large", 431: b"Request Header Fields Too Large"}


@dataclass(frozen=True)
class HttpLimits:
    max_body_bytes: int = 16 << 20
    max_header_bytes: int = 64 << 10  # the request line and every header line together
    max_headers: int = 100
    request_timeout_s: float = 30.0  # to send a request's head, and then its body


def bounded_protocol(limits: HttpLimits) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with the head's size, count and time bounded (uvicorn.Config(http=...))."""

    class BoundedHttpProtocol(HttpToolsProtocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._start_head()

        def _start_head(self):
            self._head_open, self._head_bytes, self._header_count = True, 0, 0
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(limits.request_timeout_s, self._head_timed_out)

        def _cancel_head_timer(self):
            timer = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
            self._head_timer = None

        def on_message_begin(self):
            if not self._head_open:  # the next request on a kept-alive connection
                self._start_head()
            super().on_message_begin()

        def data_received(self, data: bytes):
            if self._head_open:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._head_open and self._head_bytes > limits.max_header_bytes and not self.transport.is_closing():
                self._refuse(431, f"the request head exceeds {limits.max_header_bytes} bytes")

        def on_header(self, name: bytes, value: bytes):
            self._header_count += 1
            super().on_header(name, value)

        def on_headers_complete(self):
            self._head_open = False
            self._cancel_head_timer()
            if self._header_count > limits.max_headers:
                self._refuse(431, f"more than {limits.max_headers} header lines")
                return
            super().on_headers_complete()

        def on_body(self, body: bytes):
            if not self.transport.is_closing():  # (refused: the rest of the chunk is parsed into nothing)
                super().on_body(body)

        def on_message_complete(self):
            if not self.transport.is_closing():
                super().on_message_complete()

        def _head_timed_out(self):
            if self._head_open and not self.transport.is_closing():
                self._refuse(408, f"the request head did not arrive within {limits.request_timeout_s:g} s")

        def _refuse(self, status: int, message: str):
            """A plain-text answer and the connection closed: nothing of the request reached the application."""
            self._cancel_head_timer()
            body = message.encode()
            head = [b"HTTP/1.1 %d %s\r\n" % (status, REASONS[status])]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head.append(b"content-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n" % len(body))
            self.transport.write(b"".join(head) + b"connection: close\r\n\r\n" + body)
            self.transport.close()

        def connection_lost(self, exc):
            self._cancel_head_timer()
            super().connection_lost(exc)

    return BoundedHttpProtocol


class BoundedBody:
    """ASGI middleware that reads a request's body whole, within `max_body_bytes` and `request_timeout_s`, before
    the application runs, and hands it on as one message. `refuse(path, status, message)`: the answer (an ASGI
    app) for a body too large (413) or too slow (408)."""

    def __init__(self, app, limits: HttpLimits, refuse: Callable):
        self.app, self.limits, self.refuse = app, limits, refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        limit, timeout_s = self.limits.max_body_bytes, self.limits.request_timeout_s
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        problem = None
        try:
            async with asyncio.timeout(timeout_s):
                if not declared.isdigit():
                    problem = 400, "Content-Length is not a number"
                elif int(declared) > limit:
                    problem = 413, f"the request body is {int(declared)} bytes; this server takes at most {limit}{WHY}"
                    # read to its end and dropped: a client that sends all before it reads (and says Connection:
                    # close, as urllib does) would otherwise meet a reset instead of the answer
                    await self._read(receive, 0)
                else:
                    body = await self._read(receive, limit)
                    if body is None:
                        problem = 413, f"the request body exceeds {limit} bytes{WHY}"
        except TimeoutError:
            problem = problem or (408, f"the request body did not arrive within {timeout_s:g} s")
        except _Disconnected:
            return
        if problem is not None:
            return await self.refuse(scope["path"], *problem)(scope, receive, send)
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only a disconnect can come

        await self.app(scope, replay, send)

    @staticmethod
    async def _read(receive, limit: int) -> bytes | None:
        """The body, or None past `limit` bytes (the rest is read and dropped)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks) if size <= limit else None


class _Disconnected(Exception):
    pass
