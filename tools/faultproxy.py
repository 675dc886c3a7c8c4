"""An HTTP proxy on loopback in front of an S3-compatible endpoint that injects S3 faults: error
statuses with an S3 XML body, hangs, delays, dropped connections, a dead endpoint (stopped and
restarted on the same port), and hostile bodies (CASES C45): a body far larger than the object
(with its true Content-Length), a Content-Length that lies about the body, an endless chunked body.
Hostile bodies are streamed from one small buffer, so the proxy's own memory stays flat; a stream
ends when the client closes the connection.

Used by ``kvoffload stress --flaky-s3`` (:func:`kvoffload.tools.stress_faults.flaky_rules`) and by
the obj-tier tests; it needs nothing beyond the standard library.
"""

from __future__ import annotations

import http.client
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvoffload.tools.ports import free_port

BODY_FAULTS = ("oversized", "lying_length", "endless")
"""Actions that replace the upstream's body (the request is forwarded first)."""
_FILL = bytes(1 << 20)  # what hostile bodies are padded with, sent again and again


class Rule:
    """A fault for requests whose method is ``method`` (``"*"``: any) and whose path contains
    ``path_contains``.

    ``action``: ``("status", code, s3_error_code)`` (an S3 XML error), ``("hang", seconds)`` (no
    answer, then the connection closes), ``("delay", seconds)`` (answer normally, late),
    ``("drop",)`` (connection reset), or a hostile body after the upstream's own answer:
    ``("oversized", nbytes)`` (the upstream body padded with zeros to ``nbytes``, with that
    Content-Length), ``("lying_length", nbytes)`` (Content-Length says ``nbytes``; the upstream body
    is sent and the connection closed) or ``("endless",)`` (chunked: the upstream body, then zeros
    until the client hangs up). ``count`` faults at most (-1: unlimited); ``probability`` of
    applying to each matching request.
    """

    def __init__(
        self,
        method: str,
        path_contains: str,
        action: tuple,
        count: int = -1,
        probability: float = 1.0,
    ):
        self.method = method
        self.path_contains = path_contains
        self.action = action
        self.count = count
        self.probability = probability
        self.hits = 0


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of an S3-compatible ``upstream`` that injects faults by
    :class:`Rule`; :meth:`stop` makes it refuse connections like a dead server, :meth:`start`
    brings it back on the same port."""

    def __init__(self, upstream: str, seed: int | None = None):
        self._rng = random.Random(seed)
        self.upstream = upstream.removeprefix("http://")
        self.rules: list[Rule] = []
        self.requests: list[tuple[str, str]] = []
        self.conns: set[socket.socket] = set()
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server: ThreadingHTTPServer | None = None
        self.start()

    def start(self) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def setup(self):
                super().setup()
                proxy.conns.add(self.connection)

            def finish(self):
                proxy.conns.discard(self.connection)
                super().finish()

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                proxy.requests.append((self.command, self.path))
                body_fault = None
                for rule in list(proxy.rules):
                    if (
                        rule.method in (self.command, "*")
                        and rule.path_contains in self.path
                        and rule.count != 0
                        and (rule.probability >= 1.0 or proxy._rng.random() < rule.probability)
                    ):
                        rule.count -= 1 if rule.count > 0 else 0
                        rule.hits += 1
                        if rule.action[0] == "delay":
                            time.sleep(rule.action[1])
                            break
                        if rule.action[0] in BODY_FAULTS:
                            body_fault = rule.action
                            break
                        return self._fault(rule.action)
                conn = http.client.HTTPConnection(proxy.upstream, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                if body_fault is not None and self.command != "HEAD":
                    return self._hostile_body(body_fault, data)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _hostile_body(self, action, data: bytes):
                """Send ``data`` as a hostile body (headers sent so far: the upstream's own)."""
                self.close_connection = True
                kind = action[0]
                if kind == "endless":
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    chunk = b"%x\r\n%s\r\n" % (len(_FILL), _FILL)
                    while True:  # until the client hangs up (BrokenPipe ends the handler)
                        self.wfile.write(chunk)
                self.send_header("Content-Length", str(action[1]))
                self.end_headers()
                self.wfile.write(data)
                if kind == "oversized":
                    left = action[1] - len(data)
                    while left > 0:
                        n = min(left, len(_FILL))
                        self.wfile.write(memoryview(_FILL)[:n])
                        left -= n

            def _fault(self, action):
                if action[0] == "status":
                    code, err = action[1], action[2]
                    xml = (
                        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{err}</Code>'
                        f"<Message>injected</Message></Error>"
                    ).encode()
                    self.send_response(code)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header(
                        "Content-Length", str(len(xml) if self.command != "HEAD" else 0)
                    )
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(xml)
                elif action[0] == "hang":
                    time.sleep(action[1])
                    self.close_connection = True
                elif action[0] == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)

            def _handle_quietly(self):
                try:
                    self._handle()
                except (BrokenPipeError, ConnectionResetError, TimeoutError, OSError):
                    self.close_connection = True  # the client gave up (or the fault dropped it)

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _handle_quietly

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        """Die like a killed server: close open connections, refuse new ones."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for conn in list(self.conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def add(self, rule: Rule) -> Rule:
        self.rules.append(rule)
        return rule

    def count(self, method: str, path_contains: str) -> int:
        return sum(1 for m, p in self.requests if m == method and path_contains in p)
