"""Where chunks are: which peer holds which chunk, learned from the peers' KV events.

::

    peer A's EventPublisher ──PUB (topic, seq, KVEventBatch)──▶ SUB ┐
                            ◀─(b"", start_seq)── DEALER (replay) ───┤  one feed per publisher
    peer B's EventPublisher ──PUB──▶ SUB ───────────────────────────┤
                                                                    ▼
                 PeerLocations.poll()  (the p2p node thread, never blocking)
                    seq check per feed: in order ─▶ apply the batch
                                        gap / restart ─▶ replay from the publisher's buffer
                                                          (or forget that feed's locations)
                    apply: BlockStored / BlockRemoved per place (host tier, each secondary tier)
                                                                    ▼
                 per feed: published block hash ─▶ places bitmask   (LRU, capped per feed)
                                                                    ▼
                 where(key) ─▶ [peers holding it in their host tier] + [those holding it only in
                               a secondary tier (fs, obj, memory): they promote it, CASES C18]

Every kvoffload instance publishes its host and tier events in vLLM's ``KVEventBatch`` wire
format (:mod:`kvoffload.events`), one ``BlockStored`` / ``BlockRemoved`` per tier with its
``medium`` and ``ownership`` (None for the host tier, the secondary tier's name otherwise). This
module subscribes to the peers' publishers and keeps, per feed (one publisher endpoint), which
chunks it holds in which place. The locations are hints: the p2p tier asks the peers they name
first and still confirms with a ``Lookup``; a wrong or missing hint costs a round trip or a
fallback to asking the configured peers in order, never wrong bytes.

**Which chunk an event names.** The publisher puts in ``block_hashes`` (see
:class:`kvoffload.kv_events.KVEventTranslator`):

- for a chunk stored with a :class:`~kvoffload.events.ChunkEventInfo` (under vLLM, a chunk of a
  request): one event per chunk naming the engine's hash of the chunk's *last* block,
  ``block_size == tokens_per_chunk`` (CASES C53), ``group_idx`` the KV group. The chunk key is
  that hash plus the 4-byte big-endian group index. Earlier publishers named every block of the
  chunk with the engine block size: the chunk's hash is then every
  ``blocks_per_chunk``-th one (``blocks_per_chunk = tokens_per_chunk // block_size``), which is
  still read;
- for a chunk stored without one (a promotion, a standalone tool): one hash per chunk,
  ``block_size == tokens_per_chunk``, no ``group_idx``: the publisher's ``event_block_hash`` of
  the key, which is the key itself for a standalone manager and, under vLLM, vLLM's
  ``maybe_convert_block_hash`` of the key without its group suffix: the hash's low 64 bits as an
  int (vLLM's default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or the bytes (set to 0). The
  engine hashes of a chunk with a chunk info come through the same converter;
- in a ``BlockRemoved``: the same hashes as the chunk's ``BlockStored``, and no ``block_size``: every hash listed is cleared (a hash of a block inside a
  chunk never names a chunk of the same namespace, so clearing it is a no-op).

So the index is keyed by the published hash of the chunk's last block, and :meth:`where` turns a
key into that form (``block_hash``; by default it tries all three: the key itself, the key
without its 4-byte group suffix, and that suffix-less hash's low 64 bits as an int). KV groups whose chunks end on the same block share one entry: a hint for
"some group's chunk ending there", which the peer's ``Lookup`` answer makes exact.

**Same namespace only.** A KV event names no namespace. A peer's events are answered from
:meth:`where` only after :meth:`confirm_peer`, which the p2p node calls once that peer's server
has welcomed a session whose ``Hello`` named this instance's namespace id (one instance, one
engine, one namespace: its publisher reports only that namespace's chunks). Before that, and for
a peer refused for its namespace, its events are still kept (within its cap) but never answered.
An event whose ``block_size`` cannot describe this namespace's chunks (it does not divide
``tokens_per_chunk``, or lists no whole number of chunks) is counted ``mismatched`` and ignored.

**Places.** ``medium`` ``CPU`` with no ``ownership`` is the peer's host tier; an event with an
``ownership`` (a secondary tier's name: ``fs``, ``obj``, a ``memory`` tier whose medium is also
``CPU``) or another medium is that secondary tier. ``GPU``, ``PEER`` (chunks a peer put into
*other* peers) and a missing medium are not servable by the peer and are ignored. A chunk
removed from one place stays located while another place of the same peer holds it (C18);
``AllBlocksCleared`` forgets everything the feed said.

**Sequence numbers.** Each publisher numbers its batches without gaps from a first number below
every earlier run's on its endpoint (:func:`kvoffload.events.first_seq`; it opens with
``AllBlocksCleared``), and one PUB connection delivers them in order. A replay from 0 returns the
whole buffer, its first batch taken as the start. A feed keeps the last number received live and the next one
it expects. A live number not above the last live one is a new publisher (the peer restarted):
the feed's locations are dropped and it starts over. A number above the expected one is a gap
(batches the SUB socket lost: high-water mark, reconnection): with a ``replay_endpoint`` the feed
asks the publisher's replay buffer (vLLM's protocol, :mod:`kvoffload.events`) for the batches
from the expected one on, buffers the live batches that arrive meanwhile and applies them after
the replay; without one, it forgets its locations and goes on from the batch received. A number
between the two is a batch a replay already gave (ignored). At the start, after a restart seen
mid-stream and after :meth:`PeerLocations.drop_peer`, a feed with a replay endpoint replays from
0 (what the publisher still buffers). Until its first live batch arrives, such a feed asks again
(a catch-up replay from the next number it expects, after 0.25 s, then at doubling intervals up to
60 s): a PUB socket drops what it publishes before the SUB socket's subscription reaches it, so a
peer that published during the join and then went quiet would otherwise be located only at its
next batch. A replay that does not end within ``replay_timeout_s`` is
abandoned (what arrived is applied; a hole forgets the feed's locations) and the feed asks for
none for a backoff that doubles up to 60 s. A restart whose new publisher has already passed the
old number when the SUB reconnects looks like a gap; the p2p node's :meth:`drop_peer` on the
peer's new incarnation re-learns that peer from scratch.

**Bounds.** Each feed keeps at most ``max_chunks_per_peer`` chunk locations; when full, the chunk
stored longest ago (least recently named by a ``BlockStored``) is forgotten first and counted
``evicted``; a lookup of it falls back to asking the configured peers in order. Live batches
buffered during a replay: at most ``max_buffered_batches`` per feed (more: the replay is
abandoned). Frames over ``max_message_bytes`` make ZMQ drop the connection (it reconnects).

**Sockets.** One SUB socket per publisher (and one replay DEALER where a replay endpoint is
given), all made at construction: a ``KVEventBatch`` names no sender and every instance
publishes on the same default topic, so one SUB socket connected to several publishers could not
tell their batches (or their sequence numbers) apart.

**Threads.** :meth:`poll`, :meth:`drop_peer`, :meth:`confirm_peer`, :meth:`places` and
:meth:`close` belong to one thread (the p2p node's), which registers :attr:`sockets` in its
``zmq.Poller``. :meth:`where` and :meth:`located_chunks` only look up dictionaries (atomic under
the GIL) and may be called from any thread.

Malformed messages (wrong frame count, a bad sequence frame, a payload that is not a
``KVEventBatch``, a wrong replay answer) are counted in :attr:`counts` and ignored.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import zmq

from kvoffload.events import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvoffload.ipc.names import EVENTS_TOPIC
from kvoffload.validation import ConfigError, Positive

log = logging.getLogger("kvoffload.p2p")

HOST_PLACE = "host"
"""The place name of a peer's host tier in :meth:`PeerLocations.places`."""

_HOST_BIT = 1
_MAX_PLACES = 31  # secondary places per feed, besides the host tier
_NOT_SERVABLE = frozenset({None, "GPU", "PEER"})
_MAX_BACKOFF_S = 60.0
_CATCH_UP_FIRST_S = 0.25  # the first catch-up replay after a (re)start's replay ended
_CATCH_UP_MAX_S = 60.0

_decoder = msgspec.msgpack.Decoder(KVEventBatch)


class PeerEventSource(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """One KV-event publisher of a peer (its ``kv_events`` settings, seen from the subscriber).

    Attributes:
        endpoint: the peer's PUB endpoint to connect to (``tcp://node-b:5557``; ``ipc://``,
            ``inproc://`` too).
        replay_endpoint: the peer's replay ROUTER (its ``kv_events.replay_endpoint``), used to
            recover after a gap or a restart; None: without it, a gap forgets that feed's
            locations.
        topic: the peer's ``kv_events.topic`` (vLLM-format batches).
    """

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = EVENTS_TOPIC


PeerEvents = dict[str, str | PeerEventSource | list[str | PeerEventSource]]
"""The ``peer_events`` config value: peer id (``host:port``, as in the p2p tier's ``peers``) ->
its publisher's endpoint, a :class:`PeerEventSource` object, or a list of them (one per
data-parallel rank, each its own publisher)."""


class PeerLocationsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The p2p tier's keys for :class:`PeerLocations` (its config struct may subclass this one,
    or copy the fields and call :func:`event_sources` in its own ``__post_init__``)::

        "peer_events": {
            "node-b:5710": "tcp://node-b:5557",
            "node-c:5710": {"endpoint": "tcp://node-c:5557",
                            "replay_endpoint": "tcp://node-c:5558", "topic": "kv-events"},
            "node-d:5710": ["tcp://node-d:5557", "tcp://node-d:5558"]
        },
        "max_located_chunks": 262144,
        "replay_timeout_s": 5.0

    Attributes:
        peer_events: peer id -> where its KV events are (:data:`PeerEvents`). Peers not named
            here are asked in configured order only.
        max_located_chunks: chunk locations kept per peer publisher (the LRU cap; the default
            takes about 50 MB per publisher when full).
        replay_timeout_s: seconds a replay may take before it is abandoned (0 < s <= 3600).
    """

    peer_events: PeerEvents = msgspec.field(default_factory=dict)
    max_located_chunks: Positive = 262_144
    replay_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.replay_timeout_s <= 3600:
            raise ValueError(f"replay_timeout_s: must be in (0, 3600], got {self.replay_timeout_s}")
        event_sources(self.peer_events, "peer_events")


def event_sources(peer_events: Mapping[str, Any], where: str) -> dict[str, list[PeerEventSource]]:
    """Normalize a ``peer_events`` value (:data:`PeerEvents`, typed or raw dicts) to peer id ->
    its publishers. ``where``: the key path of the value, for messages.

    Raises:
        ConfigError: naming the key path: a peer id that is not ``host:port``, an empty list, an
            endpoint that is not ``tcp://``, ``ipc://`` or ``inproc://``, a source of the wrong
            shape, or one endpoint given twice.
    """
    out: dict[str, list[PeerEventSource]] = {}
    seen: dict[str, str] = {}
    for peer, value in peer_events.items():
        at = f"{where}[{peer!r}]"
        host, sep, port = str(peer).rpartition(":")
        if not isinstance(peer, str) or not sep or not host or not port.isdigit():
            raise ConfigError(f"{at}: a peer id is 'host:port' (the peer's p2p address)")
        items = value if isinstance(value, list) else [value]
        if not items:
            raise ConfigError(f"{at}: no event endpoint given")
        sources = []
        for i, item in enumerate(items):
            item_at = f"{at}[{i}]" if isinstance(value, list) else at
            if isinstance(item, str):
                item = PeerEventSource(endpoint=item)
            elif isinstance(item, dict):
                try:
                    item = msgspec.convert(item, PeerEventSource, strict=True)
                except msgspec.ValidationError as e:
                    raise ConfigError(f"{item_at}: {e}") from None
            elif not isinstance(item, PeerEventSource):
                raise ConfigError(
                    f"{item_at}: expected an endpoint string or an object with 'endpoint', "
                    f"'replay_endpoint', 'topic'; got {type(item).__name__}"
                )
            for name, ep in (
                ("endpoint", item.endpoint),
                ("replay_endpoint", item.replay_endpoint),
            ):
                if ep is None:
                    continue
                scheme, sep, rest = ep.partition("://")
                if scheme not in ("tcp", "ipc", "inproc") or not sep or not rest:
                    raise ConfigError(
                        f"{item_at}.{name}: {ep!r} is not a ZMQ endpoint "
                        "(tcp://host:port, ipc://path or inproc://name)"
                    )
                if ep in seen:
                    raise ConfigError(f"{item_at}.{name}: {ep!r} is also given at {seen[ep]}")
                seen[ep] = f"{item_at}.{name}"
            sources.append(item)
        out[peer] = sources
    return out


class _Replay:
    """A replay in flight on one feed."""

    __slots__ = ("deadline", "live")

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.live: dict[int, bytes] = {}  # live batches that arrived meanwhile, by seq


class _Feed:
    """One publisher of one peer: its sockets, sequence state and chunk locations."""

    __slots__ = (
        "backoff_s",
        "catch_up_at",
        "catch_up_s",
        "chunks",
        "last_live",
        "next_seq",
        "peer",
        "places",
        "replay",
        "replay_after",
        "replay_sock",
        "source",
        "sub",
        "topic",
    )

    def __init__(self, peer: str, source: PeerEventSource):
        self.peer = peer
        self.source = source
        self.topic = source.topic.encode()
        self.sub: zmq.Socket | None = None
        self.replay_sock: zmq.Socket | None = None
        # published hash of a chunk's last block -> places bitmask, least recently stored first
        self.chunks: OrderedDict[Any, int] = OrderedDict()
        self.places: dict[tuple[str | None, str | None], int] = {}  # secondary place -> bit
        self.next_seq: int | None = None  # None: no batch taken yet (or forgotten)
        self.last_live = -1  # the last sequence number received live (on the SUB socket)
        self.replay: _Replay | None = None
        self.replay_after = 0.0  # monotonic time before which no replay is asked (backoff)
        # No live batch since the feed's last (re)start: when to ask for a catch-up replay (None:
        # not waiting for one), and the interval after that one
        self.catch_up_at: float | None = None
        self.catch_up_s = _CATCH_UP_FIRST_S
        self.backoff_s = 0.0


class PeerLocations:
    """Chunk key -> the peers that hold it, from the peers' KV events (see the module docstring).

    Args:
        peer_events: peer id (``host:port``) -> its publishers (:data:`PeerEvents`; normalized
            with :func:`event_sources`). The order of the peers is the order of ties in
            :meth:`where`.
        tokens_per_chunk: tokens per chunk of this instance's namespace (to find a chunk's last
            block in events that list every block).
        block_hash: ``key -> published hash`` of a chunk (the ``event_block_hash`` the peers'
            managers publish with); None: whichever of the key itself (standalone), the key
            without its 4-byte group suffix (vLLM, bytes hashes) and that hash's low 64 bits as
            an int (vLLM's default int hashes) a peer published.
        max_chunks_per_peer: chunk locations kept per feed (LRU; > 0).
        replay_timeout_s: seconds a replay may take before it is abandoned.
        max_buffered_batches: live batches kept per feed while its replay runs.
        max_message_bytes: largest frame accepted (ZMQ ``MAXMSGSIZE``; bytes).
        where: key path of ``peer_events`` in the config, for error messages.
        context: the ZMQ context to create sockets in (default: a context of its own, terminated
            by :meth:`close`).

    Raises:
        ConfigError: a bad ``peer_events`` value, or an endpoint ZMQ cannot connect to (naming
            the peer and the endpoint).
    """

    def __init__(
        self,
        peer_events: Mapping[str, Any],
        *,
        tokens_per_chunk: int,
        block_hash: Callable[[bytes], Any] | None = None,
        max_chunks_per_peer: int = 262_144,
        replay_timeout_s: float = 5.0,
        max_buffered_batches: int = 10_000,
        max_message_bytes: int = 64 << 20,
        where: str = "peer_events",
        context: zmq.Context | None = None,
    ):
        if tokens_per_chunk <= 0 or max_chunks_per_peer <= 0 or max_buffered_batches <= 0:
            raise ValueError(
                "tokens_per_chunk, max_chunks_per_peer and max_buffered_batches must be > 0"
            )
        sources = event_sources(peer_events, where)
        self.tokens_per_chunk = tokens_per_chunk
        self.block_hash = block_hash
        self.max_chunks_per_peer = max_chunks_per_peer
        self.replay_timeout_s = replay_timeout_s
        self.max_buffered_batches = max_buffered_batches
        self.peers: tuple[str, ...] = tuple(sources)
        self.counts: dict[str, int] = dict.fromkeys(
            (
                "messages",  # messages received on SUB sockets (any content)
                "replay_answers",  # messages received on replay sockets (any content)
                "batches",  # batches applied (live and replayed)
                "malformed",  # messages or replay answers of a wrong shape, undecodable payloads
                "other_topics",  # messages of a topic that only starts with a feed's topic
                "mismatched",  # events that cannot describe this namespace's chunks
                "gaps",  # sequence gaps seen on a live stream
                "duplicates",  # live batches a replay had already given
                "restarts",  # sequence numbers going back: a new publisher
                "replays",  # replays asked for (catch-ups included)
                "catch_ups",  # replays asked for while no live batch had arrived since a start
                "replayed_batches",  # batches received from replays
                "replay_failures",  # replays abandoned (timeout, too much buffered)
                "stale_replies",  # replay answers arriving with no replay in flight
                "lost",  # holes that could not be filled: the feed's locations were dropped
                "evicted",  # chunk locations forgotten because a feed was full
            ),
            0,
        )
        self._confirmed: set[str] = set()
        self._ctx = context if context is not None else zmq.Context(1)
        if context is None:
            self._ctx.setsockopt(zmq.LINGER, 0)  # closing never waits on unsent messages
        self._own_ctx = context is None
        self._feeds: dict[str, list[_Feed]] = {
            p: [_Feed(p, s) for s in sources[p]] for p in sources
        }
        self._all: list[_Feed] = [f for fs in self._feeds.values() for f in fs]
        socks: list[zmq.Socket] = []
        try:
            for feed in self._all:
                src = feed.source
                at = f"{where}[{feed.peer!r}]"
                feed.sub = sub = self._ctx.socket(zmq.SUB)
                socks.append(sub)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.RCVHWM, 100_000)
                sub.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
                sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
                sub.setsockopt(zmq.SUBSCRIBE, feed.topic)
                self._connect(sub, src.endpoint, f"{at}.endpoint")
                if src.replay_endpoint:
                    feed.replay_sock = rs = self._ctx.socket(zmq.DEALER)
                    socks.append(rs)
                    rs.setsockopt(zmq.LINGER, 0)
                    # a replay is a burst (up to the publisher's buffer_steps, 10,000 by
                    # default); the publisher's ROUTER drops what does not fit
                    rs.setsockopt(zmq.RCVHWM, 100_000)
                    rs.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
                    rs.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
                    self._connect(rs, src.replay_endpoint, f"{at}.replay_endpoint")
        except BaseException:
            for s in socks:
                s.close()
            if self._own_ctx:
                self._ctx.term()
            raise
        self.sockets: tuple[zmq.Socket, ...] = tuple(socks)
        """Every socket to watch for POLLIN (fixed for this object's life)."""
        now = time.monotonic()
        for feed in self._all:  # learn what each publisher still buffers
            if feed.replay_sock is not None:
                self._start_replay(feed, 0, now)
        self._closed = False

    @staticmethod
    def _connect(sock: zmq.Socket, endpoint: str, at: str) -> None:
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as e:
            raise ConfigError(f"{at}: cannot connect to {endpoint!r}: {e}") from None

    # -- owner thread -----------------------------------------------------------------------------

    def register(self, poller: zmq.Poller) -> None:
        """Register :attr:`sockets` for POLLIN in ``poller``."""
        for s in self.sockets:
            poller.register(s, zmq.POLLIN)

    def next_timeout_s(self) -> float | None:
        """Seconds until :meth:`poll` must run even without traffic (a replay deadline, a
        catch-up replay due); None when nothing is waiting."""
        deadlines = [f.replay.deadline for f in self._all if f.replay is not None]
        deadlines += [
            max(f.catch_up_at, f.replay_after)
            for f in self._all
            if f.replay is None and f.catch_up_at is not None
        ]
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic())

    def poll(self, max_messages: int = 1000) -> int:
        """Take what has arrived, without blocking: live batches and replay answers, at most
        ``max_messages`` of them (shared among the feeds, so one busy peer cannot hold the node
        thread); abandon replays past their deadline. Returns the number of messages taken."""
        if self._closed:
            return 0
        feeds = self._all
        share = max(1, max_messages // max(1, len(feeds)))
        taken = 0
        now = time.monotonic()
        for feed in feeds:
            n = 0
            rs = feed.replay_sock
            while rs is not None and n < share:  # replay answers first: they precede live ones
                try:
                    frames = rs.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                n += 1
                self.counts["replay_answers"] += 1
                self._on_replay_frames(feed, frames)
            sub = feed.sub
            assert sub is not None
            while n < share:
                try:
                    frames = sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                n += 1
                self.counts["messages"] += 1
                self._on_live_frames(feed, frames)
            if feed.replay is not None and now >= feed.replay.deadline:
                log.warning(
                    "kvoffload p2p: replay of %s's events from %s took more than %g s; abandoned",
                    feed.peer,
                    feed.source.replay_endpoint,
                    self.replay_timeout_s,
                )
                self._abandon_replay(feed, now)
            due = feed.catch_up_at
            if due is not None and feed.replay is None and now >= due and self._can_replay(feed):
                self._catch_up(feed, now)
            taken += n
        return taken

    def confirm_peer(self, peer: str) -> None:
        """``peer``'s events describe chunks of this instance's namespace: its p2p server has
        welcomed a session whose ``Hello`` named this namespace. From now on :meth:`where`
        answers with it. A peer without configured events is ignored."""
        if peer in self._feeds:
            self._confirmed.add(peer)

    def drop_peer(self, peer: str) -> None:
        """Forget every location of ``peer`` and stop answering with it until
        :meth:`confirm_peer` (called when the peer is marked down or comes back with a new
        incarnation). Its feeds then learn again: from a replay from 0 where they have a replay
        endpoint, else from the next batch they receive. An unknown peer is ignored."""
        self._confirmed.discard(peer)
        now = time.monotonic()
        for feed in self._feeds.get(peer, ()):
            self._cancel_replay(feed)  # also discards answers still in flight
            feed.chunks.clear()
            feed.next_seq = None
            feed.last_live = -1
            feed.backoff_s = 0.0
            feed.replay_after = 0.0
            feed.catch_up_at = None
            feed.catch_up_s = _CATCH_UP_FIRST_S
            if feed.replay_sock is not None:
                self._start_replay(feed, 0, now)

    def close(self) -> None:
        """Close the sockets (and the context, when it is this object's own). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for s in self.sockets:
            s.close()
        if self._own_ctx:
            self._ctx.term()

    # -- any thread -------------------------------------------------------------------------------

    def where(self, key: bytes) -> list[str]:
        """The confirmed peers that hold ``key``: those with it in their host tier first, then
        those with it only in a secondary tier (servable after the peer promotes it); ties in
        configured order. Empty: no peer is known to hold it."""
        hashes = self._hash_forms(key)
        host: list[str] = []
        tier: list[str] = []
        for peer in self.peers:
            if peer not in self._confirmed:
                continue
            bits = 0
            for feed in self._feeds[peer]:
                get = feed.chunks.get
                for h in hashes:
                    bits |= get(h, 0)
            if bits & _HOST_BIT:
                host.append(peer)
            elif bits:
                tier.append(peer)
        return host + tier

    def places(self, key: bytes) -> dict[str, list[str]]:
        """Every peer (confirmed or not) known to hold ``key`` -> where: ``"host"``
        (:data:`HOST_PLACE`) and the secondary tiers by name (their ``ownership``, or their
        medium when none), host first. For diagnostics and tests (owner thread)."""
        hashes = self._hash_forms(key)
        out: dict[str, list[str]] = {}
        for peer in self.peers:
            names: list[str] = []
            for feed in self._feeds[peer]:
                bits = 0
                for h in hashes:
                    bits |= feed.chunks.get(h, 0)
                if bits & _HOST_BIT:
                    names.append(HOST_PLACE)
                for (medium, owner), bit in feed.places.items():
                    if bits & bit:
                        names.append(owner if owner is not None else str(medium))
            if names:
                out[peer] = list(dict.fromkeys(sorted(names, key=lambda n: n != HOST_PLACE)))
        return out

    def located_chunks(self, peer: str) -> int:
        """How many chunk locations are kept for ``peer`` (all its feeds; 0 for an unknown
        peer)."""
        return sum(len(f.chunks) for f in self._feeds.get(peer, ()))

    def replaying(self, peer: str) -> bool:
        """True while a replay of one of ``peer``'s feeds is in flight (owner thread)."""
        return any(f.replay is not None for f in self._feeds.get(peer, ()))

    def confirmed(self, peer: str) -> bool:
        """True when :meth:`where` answers with ``peer`` (see :meth:`confirm_peer`)."""
        return peer in self._confirmed

    def _hash_forms(self, key: bytes) -> tuple[Any, ...]:
        if self.block_hash is not None:
            return (self.block_hash(key),)
        if len(key) <= 4:
            return (key,)
        block = key[:-4]
        return (key, block, int.from_bytes(block[-8:], "big"))

    # -- sequence numbers and replays -------------------------------------------------------------

    def _on_live_frames(self, feed: _Feed, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.counts["malformed"] += 1
            return
        if frames[0] != feed.topic:
            self.counts["other_topics"] += 1
            return
        seq = int.from_bytes(frames[1], "big")
        payload = frames[2]
        feed.catch_up_at = None  # the subscription is in: a gap from now on shows in the numbers
        # One PUB connection delivers in order: a live number not above the last live one is a
        # new publisher (the peer restarted). One below the next expected but above the last
        # live one is a batch a replay already gave.
        if seq <= feed.last_live:
            self.counts["restarts"] += 1
            log.info(
                "kvoffload p2p: %s's event sequence went back (%d after %d): a new publisher; "
                "its locations are dropped",
                feed.peer,
                seq,
                feed.last_live,
            )
            if feed.replay is not None:
                self._cancel_replay(feed)
            self._forget(feed, lost=False)
            feed.last_live = seq
            self._first_batch(feed, seq, payload)
            return
        feed.last_live = seq
        replay = feed.replay
        if replay is not None:
            replay.live[seq] = payload
            if len(replay.live) > self.max_buffered_batches:
                log.warning(
                    "kvoffload p2p: more than %d batches of %s's events arrived during a "
                    "replay; the replay is abandoned",
                    self.max_buffered_batches,
                    feed.peer,
                )
                self._abandon_replay(feed, time.monotonic())
            return
        expected = feed.next_seq
        if expected is None:
            self._first_batch(feed, seq, payload)
        elif seq == expected:
            self._apply(feed, payload)
            feed.next_seq = seq + 1
        elif seq < expected:
            self.counts["duplicates"] += 1
        else:
            self.counts["gaps"] += 1
            if self._can_replay(feed) and self._start_replay(feed, expected, time.monotonic()):
                assert feed.replay is not None
                feed.replay.live[seq] = payload
            else:
                self._forget(feed, lost=True)
                self._apply(feed, payload)
                feed.next_seq = seq + 1

    def _first_batch(self, feed: _Feed, seq: int, payload: bytes) -> None:
        """The first batch taken since the start or since the feed's locations were dropped."""
        # earlier batches may still be in the publisher's buffer
        if seq > 0 and self._can_replay(feed) and self._start_replay(feed, 0, time.monotonic()):
            assert feed.replay is not None
            feed.replay.live[seq] = payload
            return
        self._apply(feed, payload)
        feed.next_seq = seq + 1

    def _can_replay(self, feed: _Feed) -> bool:
        return feed.replay_sock is not None and time.monotonic() >= feed.replay_after

    def _start_replay(self, feed: _Feed, start: int, now: float) -> bool:
        """Ask the feed's replay endpoint for every buffered batch from ``start`` on; False when
        the request cannot be queued (the caller goes on without a replay)."""
        sock = feed.replay_sock
        assert sock is not None and feed.replay is None
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big")), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.info("kvoffload p2p: cannot ask %s for a replay: %s", feed.peer, e)
            return False
        self.counts["replays"] += 1
        # from 0: whatever the publisher still buffers, its first batch included (a run's
        # numbers start where kvoffload.events.first_seq says, not at 0): no hole before it
        feed.next_seq = start or None
        feed.replay = _Replay(now + self.replay_timeout_s)
        return True

    def _on_replay_frames(self, feed: _Feed, frames: list[bytes]) -> None:
        replay = feed.replay
        if replay is None:
            self.counts["stale_replies"] += 1
            return
        # (b"", topic, seq, payload) per batch, then (b"", b"", END_SEQ, b"")
        if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
            self.counts["malformed"] += 1
            return
        _, topic, seq_bytes, payload = frames
        if seq_bytes == END_SEQ and topic == b"":
            self._finish_replay(feed)
            return
        if topic != feed.topic:
            self.counts["malformed"] += 1
            return
        self.counts["replayed_batches"] += 1
        self._take_in_order(feed, int.from_bytes(seq_bytes, "big"), payload)

    def _take_in_order(self, feed: _Feed, seq: int, payload: bytes, live: bool = False) -> None:
        """Apply a batch of a replay (or, ``live``, one buffered during it) if it is not older
        than the next expected; a hole before it forgets the feed's locations."""
        expected = feed.next_seq
        if expected is not None and seq < expected:
            if live:
                self.counts["duplicates"] += 1  # a live batch the replay had already given
            return  # already taken
        if expected is not None and seq > expected:
            self._forget(feed, lost=True)
        self._apply(feed, payload)
        feed.next_seq = seq + 1

    def _finish_replay(self, feed: _Feed) -> None:
        replay = feed.replay
        assert replay is not None
        feed.replay = None
        feed.backoff_s = 0.0
        for seq in sorted(replay.live):
            self._take_in_order(feed, seq, replay.live[seq], live=True)
        self._await_live(feed, time.monotonic())

    def _await_live(self, feed: _Feed, now: float) -> None:
        """After a replay ended: while no live batch has arrived since the feed's (re)start, a
        catch-up replay is due (the batches published before the subscription took effect are
        lost to the SUB socket, and an idle publisher sends nothing that would show the gap)."""
        if feed.last_live < 0 and feed.replay_sock is not None:
            feed.catch_up_at = now + feed.catch_up_s
            feed.catch_up_s = min(_CATCH_UP_MAX_S, 2 * feed.catch_up_s)

    def _catch_up(self, feed: _Feed, now: float) -> None:
        """Ask for what the publisher buffered after the batches taken so far."""
        feed.catch_up_at = None
        start = feed.next_seq if feed.next_seq is not None else 0
        if not self._start_replay(feed, start, now):
            self._await_live(feed, now)  # ask again later
        else:
            self.counts["catch_ups"] += 1

    def _abandon_replay(self, feed: _Feed, now: float) -> None:
        """Give up the feed's replay: apply what arrived, stop asking for a backoff."""
        replay = feed.replay
        assert replay is not None
        self.counts["replay_failures"] += 1
        self._cancel_replay(feed)
        feed.backoff_s = min(_MAX_BACKOFF_S, max(self.replay_timeout_s, 2 * feed.backoff_s))
        feed.replay_after = now + feed.backoff_s
        for seq in sorted(replay.live):
            self._take_in_order(feed, seq, replay.live[seq], live=True)
        self._await_live(feed, now)

    def _cancel_replay(self, feed: _Feed) -> None:
        """End the feed's replay and discard its answers still in flight (reconnecting the
        DEALER drops what the old connection queued)."""
        feed.replay = None
        sock, ep = feed.replay_sock, feed.source.replay_endpoint
        if sock is not None and ep:
            try:
                sock.disconnect(ep)
            except zmq.ZMQError:  # never connected (an unresolved name): nothing queued
                pass
            sock.connect(ep)

    # -- applying batches -------------------------------------------------------------------------

    def _forget(self, feed: _Feed, *, lost: bool) -> None:
        if lost:
            self.counts["lost"] += 1
            if feed.chunks:
                log.info(
                    "kvoffload p2p: %s's events have a hole; its %d chunk location(s) from %s "
                    "are dropped",
                    feed.peer,
                    len(feed.chunks),
                    feed.source.endpoint,
                )
        feed.chunks.clear()

    def _apply(self, feed: _Feed, payload: bytes) -> None:
        try:
            batch = _decoder.decode(payload)
        except msgspec.DecodeError:  # ValidationError included
            self.counts["malformed"] += 1
            return
        self.counts["batches"] += 1
        chunks = feed.chunks
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                bit = self._place_bit(feed, ev.medium, ev.ownership)
                if not bit:
                    continue
                hashes = self._stored_chunk_hashes(ev)
                if hashes is None:
                    self.counts["mismatched"] += 1
                    continue
                for h in hashes:
                    chunks[h] = chunks.get(h, 0) | bit
                    chunks.move_to_end(h)
                over = len(chunks) - self.max_chunks_per_peer
                if over > 0:
                    self.counts["evicted"] += over
                    for _ in range(over):
                        chunks.popitem(last=False)
            elif isinstance(ev, BlockRemoved):
                bit = self._place_bit(feed, ev.medium, ev.ownership)
                if not bit:
                    continue
                for h in ev.block_hashes:
                    bits = chunks.get(h)
                    if bits is not None:
                        bits &= ~bit
                        if bits:
                            chunks[h] = bits
                        else:
                            del chunks[h]
            elif isinstance(ev, AllBlocksCleared):
                chunks.clear()

    def _place_bit(self, feed: _Feed, medium: str | None, ownership: str | None) -> int:
        """The bit of a place in the feed's bitmasks; 0 for a place the peer cannot serve from
        (or one too many)."""
        if medium in _NOT_SERVABLE:
            return 0
        if medium == "CPU" and ownership is None:
            return _HOST_BIT
        place = (medium, ownership)
        bit = feed.places.get(place)
        if bit is None:
            if len(feed.places) >= _MAX_PLACES:
                self.counts["mismatched"] += 1
                return 0
            bit = feed.places[place] = _HOST_BIT << (len(feed.places) + 1)
        return bit

    def _stored_chunk_hashes(self, ev: BlockStored) -> Sequence[Any] | None:
        """The published hashes of the chunks a ``BlockStored`` names (each chunk's last
        block); None when the event cannot describe whole chunks of this namespace."""
        bs = ev.block_size
        if bs <= 0 or self.tokens_per_chunk % bs:
            return None
        per_chunk = self.tokens_per_chunk // bs
        hashes = ev.block_hashes
        if per_chunk == 1:
            return hashes
        if len(hashes) % per_chunk:
            return None
        return hashes[per_chunk - 1 :: per_chunk]
