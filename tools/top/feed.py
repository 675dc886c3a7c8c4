"""What ``kvoffload top`` reads: the metrics endpoint (one scrape per call, off the UI thread) and
the KV events publisher's movements topic (a ZMQ SUB socket drained without blocking).

::

    engine / stress run                            kvoffload top
    GET /metrics ──HTTP (urllib, in a thread)────▶ fetch_snapshot() ─▶ Snapshot (model.py)
    PUB socket ──ZMQ (topic, seq, payload)───────▶ MovementFeed.poll() ─▶ [ReceivedMovement]

Events: frames ``(topic, 8-byte big-endian seq, msgpack payload)`` (``docs/observability.md``);
the payload is decoded with the publisher's own schema, :class:`kvoffload.events.MovementBatch`,
so the monitor and the publisher cannot disagree about a field. Gaps in ``seq`` are counted as
missed messages; a socket monitor tells whether a publisher is connected.
"""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvoffload.events import MovementBatch
from kvoffload.ipc.names import MOVEMENTS_TOPIC
from kvoffload.tools.top.model import ReceivedMovement, Snapshot, parse_exposition

DEFAULT_MOVEMENTS_TOPIC = MOVEMENTS_TOPIC  # the publisher's default (kvoffload.ipc.names)

_BATCH = msgspec.msgpack.Decoder(MovementBatch)


# -- metrics ----------------------------------------------------------------------------------


def fetch_snapshot(url: str, timeout: float) -> Snapshot:
    """GET ``url`` (at most ``timeout`` seconds per socket operation) and parse it. Blocks: call it
    from a thread. Raises OSError (URLError, HTTPError, timeouts), http.client.HTTPException or
    ValueError (not an exposition)."""
    req = urllib.request.Request(url, headers={"Accept": "text/plain"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        text = resp.read().decode("utf-8")
    return parse_exposition(text, time.monotonic(), time.time())


def describe_error(e: BaseException) -> str:
    """One line for a banner: what went wrong, without a traceback."""
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):
        reason = e.reason
        return describe_error(reason) if isinstance(reason, BaseException) else str(reason)
    if isinstance(e, (socket.timeout, TimeoutError)):
        return "timed out"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def normalize_metrics_url(url: str) -> str:
    """``HOST:PORT`` → ``http://HOST:PORT/metrics``; a URL with a scheme and a path is kept."""
    if "://" not in url:
        url = f"http://{url}"
    scheme, rest = url.split("://", 1)
    if "/" not in rest:
        url = f"{scheme}://{rest}/metrics"
    return url


# -- movement events --------------------------------------------------------------------------


def decode_movements(frames: Sequence[bytes]) -> tuple[str, int, list[ReceivedMovement]]:
    """``(topic, seq, movements)`` of one message ``(topic, 8-byte big-endian seq, payload)``,
    payload a :class:`kvoffload.events.MovementBatch` in msgpack (``docs/observability.md``).

    Raises:
        ValueError: any other shape (frame count, seq length, a payload the schema refuses).
    """
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError(f"expected 3 frames (topic, 8-byte seq, payload), got {len(frames)}")
    topic, seq = bytes(frames[0]).decode("utf-8", "replace"), int.from_bytes(frames[1], "big")
    try:
        batch = _BATCH.decode(frames[2])
    except msgspec.DecodeError as e:  # ValidationError included
        raise ValueError(f"undecodable movements payload: {describe_error(e)}") from None
    out = [
        ReceivedMovement(batch.ts, batch.instance, e.key, e.src, e.dst, e.locality, e.nbytes)
        for e in batch.events
    ]
    return topic, seq, out


def normalize_events_endpoint(endpoint: str) -> str:
    """``HOST:PORT`` → ``tcp://HOST:PORT``; an endpoint with a transport is kept."""
    return endpoint if "://" in endpoint else f"tcp://{endpoint}"


class MovementFeed:
    """A ZMQ SUB socket on a KV-events publisher, subscribed to ``topic``; :meth:`poll` never
    blocks.

    State for the banner: ``connected`` (a publisher is connected), ``error`` (why not; None when
    connected), ``last_message_wall`` (``time.time()`` of the newest message). Counters:
    ``messages``, ``movements``, ``missed`` (messages lost, from gaps in ``seq``), ``malformed``
    (messages that did not decode; the newest reason in ``last_malformed``),
    ``publisher_restarts`` (``seq`` went backwards).
    """

    RETRY_SOCKET_S = 5.0  # after a connect() error (a bad endpoint), try again this often
    CONNECT_GRACE_S = 3.0  # not connected this long after connecting: say so

    def __init__(
        self,
        endpoint: str,
        topic: str = DEFAULT_MOVEMENTS_TOPIC,
        context: zmq.Context | None = None,
    ):
        self.endpoint = normalize_events_endpoint(endpoint)
        self.topic = topic.encode()
        self._ctx = context or zmq.Context()
        self._own_ctx = context is None
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._opened_at = 0.0
        self._next_seq: int | None = None
        self.connected = False
        self.error: str | None = None
        self.last_malformed: str | None = None
        self.last_message_wall: float | None = None
        self.messages = self.movements = self.missed = self.malformed = self.publisher_restarts = 0
        self._open()

    def _open(self) -> None:
        self._opened_at = time.monotonic()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)  # a burst between two polls is not dropped
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        monitor = sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
        )
        try:
            sock.connect(self.endpoint)
        except zmq.ZMQError as e:
            self.error = f"cannot connect to {self.endpoint}: {e}"
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            return
        self._sock, self._monitor = sock, monitor

    def _watch_connection(self) -> None:
        while self._monitor is not None:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            kind = event["event"]
            if kind == zmq.EVENT_CONNECTED:
                self.connected, self.error = True, None
            elif kind == zmq.EVENT_DISCONNECTED:
                self.connected, self.error = False, "publisher went away (reconnecting)"
            elif kind == zmq.EVENT_CONNECT_RETRIED:
                self.connected = False
                self.error = "no publisher accepts connections there (retrying)"
        if (
            not self.connected
            and self.error is None
            and time.monotonic() - self._opened_at > self.CONNECT_GRACE_S
        ):
            self.error = f"not connected after {self.CONNECT_GRACE_S:.0f} s (retrying)"

    def poll(self, max_messages: int = 2000) -> list[ReceivedMovement]:
        """Movements of the messages waiting now (at most ``max_messages``), oldest first."""
        if self._sock is None:
            if time.monotonic() - self._opened_at >= self.RETRY_SOCKET_S:
                self._open()
            return []
        self._watch_connection()
        out: list[ReceivedMovement] = []
        for _ in range(max_messages):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if frames[0] != self.topic:  # SUBSCRIBE matches prefixes: another topic
                continue
            try:
                _, seq, movements = decode_movements(frames)
            except ValueError as e:
                self.malformed += 1
                self.last_malformed = str(e)
                continue
            if self._next_seq is not None and seq > self._next_seq:
                self.missed += seq - self._next_seq
            elif self._next_seq is not None and seq < self._next_seq:
                self.publisher_restarts += 1
            self._next_seq = seq + 1
            self.messages += 1
            self.movements += len(movements)
            self.last_message_wall = time.time()
            self.connected = True
            out.extend(movements)
        return out

    def close(self) -> None:
        if self._sock is not None:
            self._sock.disable_monitor()
            self._sock.close(linger=0)
        if self._monitor is not None:
            self._monitor.close(linger=0)
        self._sock = self._monitor = None
        if self._own_ctx:
            self._ctx.term()
