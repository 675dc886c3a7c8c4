"""KV events for cache-aware routers (llm-d, Dynamo) on a ZMQ PUB socket.

Two streams on one socket, each message three frames ``(topic, seq, payload)`` with ``seq`` an
8-byte big-endian counter, gap-free per topic, from the run's :func:`first_seq` (below the numbers
of every earlier run on the endpoint: a restart is a sequence that goes back, a gap one that
jumps forward; CASES C54). A run's first engine batch is ``[AllBlocksCleared]``: whatever an
earlier run announced is gone; chunks persistent tiers still hold are announced again as the
tiers report them.

- ``topic``: vLLM's own wire format. ``payload`` is the msgpack of a ``KVEventBatch``
  (array-like ``[ts, events, data_parallel_rank]``) whose events are ``BlockStored`` /
  ``BlockRemoved`` tagged structs with a ``medium`` per tier (``CPU`` for the host tier, the tier's
  medium, e.g. ``STORAGE``, for the others), ``locality`` (``LOCAL``, or ``REMOTE`` for an object
  store or a peer) and ``ownership`` (the secondary tier's name). The structs below mirror
  ``vllm/distributed/kv_events.py`` (vLLM 0.32) field for field, so a consumer built for vLLM's
  events decodes ours with vLLM's own decoder. A chunk stored with a :class:`ChunkEventInfo`
  gets one ``BlockStored`` of its own, chunk-granular (CASES C53): the engine's hash of its last
  block (what a lookup finds it by), the parent hash of its first block, its token ids and
  ``block_size`` the chunk's token count; with one block per chunk, the values of the engine's
  own (``GPU``) event for that block.
- ``movements_topic``: one :class:`Movement` per chunk moved between tiers (``device`` → ``host``
  offload, ``host`` → tier write-through, tier → ``host`` promotion, ``host`` → ``device`` reload,
  tier → ``none`` eviction), in a :class:`MovementBatch` msgpack map: the one definition of that
  schema, for the publisher and for consumers (``kvoffload top``), which decode with
  :func:`decode_movement_batch` / :func:`decode_movement_message`.

Default topics: :data:`kvoffload.ipc.names.EVENTS_TOPIC` and ``MOVEMENTS_TOPIC``.

Replay (vLLM's protocol): a DEALER on ``replay_endpoint`` sends ``(b"", start_seq)``; the publisher
answers ``(b"", topic, seq, payload)`` for each buffered engine batch with ``seq >= start_seq``, then
``(b"", b"", END_SEQ, b"")``. ``(b"", start_seq, topic)`` replays the named topic instead.

Data parallel: rank ``r`` binds the configured TCP port + ``r`` (``inproc://x`` becomes
``inproc://x_dp<r>``; port 0 stays 0), the rule of vLLM's ``ZmqEventPublisher``, and every batch
of both topics carries ``data_parallel_rank``.

The engine thread only queues Python objects (:meth:`EventPublisher.publish`); encoding, sending and
replay run in the publisher's own thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, overload

import msgspec
import zmq

if TYPE_CHECKING:
    from kvoffload.config import KVEventsConfig

log = logging.getLogger("kvoffload.events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


# -- vLLM's KV event format (vllm/distributed/kv_events.py) ---------------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's event batch (msgpack array): ``ts`` (seconds since the epoch), the events, and the
    data-parallel rank that published them (None without data parallelism)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of vLLM's KV cache events (tag field ``type``, the class name)."""


class BlockStored(KVCacheEvent):
    """Chunks stored in a medium. ``block_hashes`` are kvoffload chunk keys (bytes)."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Chunks removed from a medium."""

    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every chunk of the publisher's media is gone (a reset)."""


class KVEventBatch(EventBatch):
    """An :class:`EventBatch` of KV cache events, as vLLM's ``KVEventBatch`` decodes it."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class ChunkEventInfo(msgspec.Struct, gc=False):
    """What the engine knows of one chunk, for its ``BlockStored`` events (optional per key in
    :meth:`kvoffload.tiering.TieringManager.prepare_store`).

    Attributes:
        block_hashes: the engine's hashes of the chunk's blocks, in order (``blocks_per_chunk``
            of them; bytes, or ints where the engine publishes int hashes).
        parent_block_hash: the hash of the block before the chunk's first block; None for the
            first chunk of a prefix.
        token_ids: the chunk's token ids (``blocks_per_chunk * block_size`` of them).
        block_size: tokens per engine block.
        group_idx: the engine's KV-cache group of the chunk (None: not reported).
    """

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    group_idx: int | None = None


#: Where a run's sequence numbers start below: 2**62, well inside the 8-byte signed range vLLM's
#: replay protocol uses (its end marker is -1).
SEQ_CEILING = 1 << 62


def first_seq(now_ns: int | None = None) -> int:
    """The first sequence number of a publisher started at ``now_ns`` (``time.time_ns()``):
    :data:`SEQ_CEILING` minus the microseconds since the Unix epoch. Each run starts below the
    previous one on the same endpoint (a run's numbers grow by one a batch, a microsecond at a
    time at most), so a restart is a sequence that goes back and a gap one that jumps forward
    (CASES C54); a wall clock stepped back by more than the time between the two starts breaks
    that, and the ``AllBlocksCleared`` each run opens with still tells the restart."""
    ns = time.time_ns() if now_ns is None else now_ns
    return SEQ_CEILING - ns // 1000


@overload
def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str: ...
@overload
def offset_endpoint(endpoint: None, data_parallel_rank: int) -> None: ...
def offset_endpoint(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """``endpoint`` for data-parallel rank ``data_parallel_rank``: TCP port + rank, ``inproc``
    name + ``_dp<rank>``; rank 0, None and TCP port 0 unchanged (vLLM's
    ``ZmqEventPublisher.offset_endpoint_port``).

    Raises:
        ValueError: an endpoint that is neither ``tcp://host:port`` nor ``inproc://``, or whose
            port is not a number (naming it).
    """
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    host, sep, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit():
        raise ValueError(
            f"cannot offset endpoint {endpoint!r} for data-parallel rank "
            f"{data_parallel_rank}: expected tcp://host:port or inproc://name"
        )
    return endpoint if int(port) == 0 else f"{host}:{int(port) + data_parallel_rank}"


# -- chunk movements ------------------------------------------------------------------------------


class Movement(msgspec.Struct, gc=False):
    """One chunk moved: ``src`` → ``dst`` (``device``, ``host``, a tier name, or ``none`` for an
    eviction); ``locality`` ``local`` / ``remote`` (of the tier side); ``nbytes`` payload bytes;
    ``peer`` the other instance (``host:port``) when the tier side is a peer's host tier (the p2p
    tier), else empty."""

    key: bytes
    src: str
    dst: str
    locality: str
    nbytes: int
    peer: str = ""


class MovementBatch(msgspec.Struct, gc=False):
    """A step's movements. ``ts`` wall-clock seconds; ``instance`` the publishing manager;
    ``data_parallel_rank`` the engine's data-parallel rank."""

    ts: float
    instance: str
    events: list[Movement]
    data_parallel_rank: int | None = None


_movement_batch_decoder = msgspec.msgpack.Decoder(MovementBatch)


def decode_movement_batch(payload: bytes) -> MovementBatch:
    """The :class:`MovementBatch` in the payload (third frame) of a ``movements_topic`` message.

    Raises:
        msgspec.DecodeError: not msgpack, or not a movement batch (``msgspec.ValidationError``, a
            subclass, naming the field: ``Object missing required field `src` - at
            `$.events[0]```).
    """
    return _movement_batch_decoder.decode(payload)


def decode_movement_message(frames: Sequence[bytes]) -> tuple[bytes, int, MovementBatch]:
    """``(topic, seq, batch)`` of one ``movements_topic`` message, the three frames ``(topic,
    8-byte big-endian seq, payload)`` a SUB socket receives.

    Raises:
        ValueError: not three frames, or a ``seq`` frame that is not 8 bytes.
        msgspec.DecodeError: a payload that is not a :class:`MovementBatch`.
    """
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError(
            f"expected 3 frames (topic, 8-byte seq, payload), got {len(frames)}"
            + (f" with a {len(frames[1])}-byte seq" if len(frames) == 3 else "")
        )
    topic, seq, payload = frames
    return bytes(topic), int.from_bytes(seq, "big"), decode_movement_batch(payload)


class EventPublisher:
    """The PUB socket (and optional replay ROUTER) with its sending thread.

    Args:
        config: :class:`~kvoffload.config.KVEventsConfig`.
        instance: instance label carried by movement batches.
        data_parallel_rank: the engine's data-parallel rank: offsets the endpoints
            (:func:`offset_endpoint`) and is stamped on every batch.

    Raises:
        zmq.ZMQError: an endpoint cannot be bound (at construction, in the caller's thread).
        ValueError: an endpoint cannot be offset for a rank > 0.
    """

    def __init__(self, config: KVEventsConfig, instance: str = "", data_parallel_rank: int = 0):
        self.config = config
        self.instance = instance
        self.data_parallel_rank = data_parallel_rank
        endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        replay_endpoint = offset_endpoint(config.replay_endpoint, data_parallel_rank)
        self._ctx = zmq.Context(1)
        self._topics = (config.topic.encode(), config.movements_topic.encode())
        self.published = {"engine": 0, "movements": 0}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        #: This run's first sequence number, on both topics (CASES C54): below every number an
        #: earlier run on the same endpoint used, so a subscriber sees a restart as its
        #: sequence going back, never as a gap or a batch already seen. :func:`first_seq`.
        self.first_seq = first_seq()
        self._seq = {t: self.first_seq for t in self._topics}
        self._buffers: dict[bytes, deque[tuple[int, bytes]]] = {
            t: deque(maxlen=config.buffer_steps) for t in self._topics
        }
        self._pub: zmq.Socket | None = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        pub = self._pub
        try:
            pub.setsockopt(zmq.SNDHWM, config.hwm)
            pub.setsockopt(zmq.LINGER, 500)
            pub.bind(endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if replay_endpoint:
                self._replay = replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                # A replay is every buffered batch at once: past a send high-water mark a ROUTER
                # drops what does not fit, silently, and the client would take a gap for the
                # whole history (it gets the end marker). No limit (a replay is bounded by the
                # buffer), and a client that went away is an error, not a silent drop.
                replay.setsockopt(zmq.SNDHWM, 0)
                replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                replay.bind(replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        # A run starts by saying that whatever an earlier run on this endpoint announced is gone
        # (a router drops the pod's entries); what persistent tiers still hold is announced
        # again as they report it (CASES C54).
        self.publish([AllBlocksCleared()], [])
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, name="kvoffload-events", daemon=True
        )
        self._thread.start()

    # -- engine thread ----------------------------------------------------------------------------

    def publish(self, engine_events: list, movements: list[Movement]) -> None:
        """Queue one step's events (either list may be empty). Never blocks."""
        if engine_events or movements:
            self._queue.put((time.time(), engine_events, movements))

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Block until everything queued before this call has been sent and buffered for replay.

        Returns False if the publisher thread did not get there within ``timeout_s`` seconds (or is
        closed). For tools and tests; the engine thread never calls it.
        """
        if self._thread is None:
            return False
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued, then close the sockets. Idempotent."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._thread = None
        if self._pub is not None:
            self._close_sockets()

    # -- publisher thread -------------------------------------------------------------------------

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close()
        self._pub = self._replay = None
        self._ctx.term()

    def _send(self, topic: bytes, payload: bytes) -> None:
        seq = self._seq[topic]
        self._seq[topic] = seq + 1
        assert self._pub is not None  # closed only by this thread, after its last send
        self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), copy=False)
        self._buffers[topic].append((seq, payload))

    def _run(self) -> None:
        enc = msgspec.msgpack.Encoder()
        engine_topic, moves_topic = self._topics
        rank = self.data_parallel_rank
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay(self._replay)
                except zmq.ZMQError as e:
                    log.warning("kvoffload events: replay request failed: %s", e)
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                break
            if isinstance(item, threading.Event):  # flush(): all before it is sent
                item.set()
                continue
            ts, engine_events, movements = item
            try:
                if engine_events:
                    self._send(
                        engine_topic,
                        enc.encode(
                            KVEventBatch(ts=ts, events=engine_events, data_parallel_rank=rank)
                        ),
                    )
                    self.published["engine"] += 1
                if movements:
                    self._send(
                        moves_topic,
                        enc.encode(
                            MovementBatch(
                                ts=ts,
                                instance=self.instance,
                                events=movements,
                                data_parallel_rank=rank,
                            )
                        ),
                    )
                    self.published["movements"] += 1
            except zmq.ZMQError as e:  # a full HWM drops, as ZMQ PUB does; never stop the thread
                log.warning("kvoffload events: publish failed: %s", e)
        self._close_sockets()

    def _serve_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) not in (3, 4) or len(frames[2]) != 8:
            log.warning("kvoffload events: malformed replay request (%d frames)", len(frames))
            return
        client = frames[0]
        start = int.from_bytes(frames[2], "big")
        topic = frames[3] if len(frames) == 4 else self._topics[0]
        try:
            for seq, payload in list(self._buffers.get(topic, ())):
                if seq >= start:
                    replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
            replay.send_multipart((client, b"", b"", END_SEQ, b""))
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            log.warning("kvoffload events: a replay client went away mid-replay; its replay ends")
