"""The p2p tier (``type: "p2p"``): other instances' host tiers, host to host (arena to arena).

::

    lookup(key, req) ─ known at a peer ──▶ HIT ─▶ submit_load: Lease at that peer ─▶ worker READs the
         │                                        leased slots into the reserved host slots ─▶ Release
         ├─ known absent ─▶ MISS                  (one JobResult when every peer's part has settled)
         └─ unknown ─▶ RETRY; the node asks the request's named peer, then the peers whose KV events
                       show the key (a salted request's: its engine key), then the configured peers
                       in order (Lookup, of the key as asked), until one has it
    submit_store(job) ─ the request names a remote decoder ─▶ held (slots pinned) until that decoder
         │              has fetched the chunks (its lease released) or ``hold_s`` passes
         └─ push ─▶ Offer to the peer with the most free quota; it pulls the chunks itself; Pulled

**Engine thread to node thread.** The methods here never block and never touch a socket: what the
node must do goes as a command (:mod:`.commands`: Probe, Load, Push, Connect) on a deque with a
wake-up byte, and what it found comes back as results on another deque (Verdict, LoadDone,
PushDone, PeerDown, Fetched), applied at the next lookup or ``get_finished_jobs``.

**Node thread to peers.** Control messages (:mod:`kvoffload.ipc.peer_messages`) and every socket live
in the node thread (:mod:`.node`): its client role (:mod:`.client`) asks peers, its serving role
(:mod:`.server`) answers them from this instance's host tier under ``TieringManager.lock``, so an
idle engine still serves. Bytes move in the peer worker process (:mod:`.worker_handle`,
:mod:`kvoffload.workers.p2p_transport`).

**Routing** from an orchestrator comes per request in ``kv_transfer_params``
(:meth:`P2PTier.on_request`, :mod:`.routing`): ``remote_prefiller`` (a decoder: pull from that
prefiller only), ``remote_decoder`` (a prefiller: hold the request's chunks for that decoder),
``remote_kv_source`` (probe that peer first). A peer a request names must pass the allow-list
(:class:`~.routing.PeerPolicy`) before anything is sent to the node: one that does not is
refused (counted by reason, logged once per address) and the request goes on without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import traceback
from collections import OrderedDict
from typing import Any

import zmq
from cachetools import LRUCache, TLRUCache
from typing_extensions import override

from kvoffload.config import ConfigError
from kvoffload.metrics import Counter, Gauge, Histogram, MetricSet
from kvoffload.tiers.base import (
    JobMetadata,
    JobResult,
    LookupResult,
    SecondaryTierManager,
    ServedHost,
    TierEvent,
)
from kvoffload.tiers.p2p.commands import (
    Connect,
    Fetched,
    Load,
    LoadDone,
    PeerDown,
    Probe,
    Push,
    PushDone,
    Verdict,
)
from kvoffload.tiers.p2p.config import P2PTierConfig
from kvoffload.tiers.p2p.locations import PeerLocations
from kvoffload.tiers.p2p.node import SWITCH_INTERVAL, PeerNode
from kvoffload.tiers.p2p.routing import ROUTE_REFUSALS, PeerPolicy, Route, parse_route

log = logging.getLogger("kvoffload.p2p")

_HIT, _MISS, _RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
_STUCK_CONTEXTS: list[Any] = []  # contexts of node threads that did not stop (see shutdown)


MAX_DOWN_LOG = 4096
"""Peers whose last going down the engine thread remembers (requests may name many peers)."""


class _DownLog(LRUCache[str, int]):
    """peer -> the sequence number of its last going down, for at most ``maxsize`` peers (least
    recently used forgotten first). A peer no longer in it is taken to have gone down at the
    latest number forgotten (:meth:`last`), which is at least its own: so forgetting a peer can
    only void verdicts learnt before that number, never revive one learnt before its going down.
    Entries only ever leave by eviction (nothing deletes one)."""

    def __init__(self, maxsize: int):
        super().__init__(maxsize=maxsize)
        self.floor = 0  # the latest sequence number forgotten

    def popitem(self) -> tuple[str, int]:  # cachetools calls it to evict
        peer, seq = super().popitem()
        self.floor = max(self.floor, seq)
        return peer, seq

    def last(self, peer: str) -> int:
        """The sequence number of ``peer``'s last going down (0: never, as far as known)."""
        seq = self.get(peer)
        return self.floor if seq is None else seq


class _Hold:
    """A store job held for the remote decoder of ``kvr`` until ``deadline`` (monotonic seconds):
    its slots stay pinned; ``fetched``: the keys that decoder has read so far."""

    __slots__ = ("kvr", "meta", "deadline", "fetched")

    def __init__(self, kvr: str, meta: JobMetadata, deadline: float):
        self.kvr = kvr
        self.meta = meta
        self.deadline = deadline
        self.fetched: set[bytes] = set()


class _LoadJob:
    __slots__ = ("meta", "parts", "ok", "failed", "nbytes", "t0")

    def __init__(self, meta: JobMetadata, parts: int):
        self.meta = meta
        self.parts = parts
        self.ok: list[bytes] = []
        self.failed: dict[bytes, str] = {}
        self.nbytes = 0
        self.t0 = time.monotonic()


class P2PTier(SecondaryTierManager):
    """Peers' host tiers as a secondary tier; see the module docstring and DESIGN.md."""

    config_class = P2PTierConfig
    config: P2PTierConfig
    medium = "PEER"
    shared = True
    metric_definitions = (
        Counter(
            "kvoffload_p2p_bytes",
            "Bytes moved with a peer (direction load: read from it; push: it pulled ours).",
            ("tier", "peer", "direction"),
        ),
        Counter(
            "kvoffload_p2p_chunks",
            "Chunks moved with a peer, by direction and outcome (ok, failed).",
            ("tier", "peer", "direction", "outcome"),
        ),
        Counter(
            "kvoffload_p2p_lookups",
            "Chunks asked of a peer, and those it had (result hit, asked).",
            ("tier", "peer", "result"),
        ),
        Histogram(
            "kvoffload_p2p_load_latency_seconds",
            "From a load's lease request to its bytes settled in host slots, per peer (seconds).",
            ("tier", "peer"),
        ),
        Gauge("kvoffload_p2p_peer_up", "1 while the session with a peer is up.", ("tier", "peer")),
        Gauge(
            "kvoffload_p2p_transport",
            "1 for the bulk transport this instance's peer worker runs (nixl or tcp; with transport "
            "auto, NIXL when it can run), 0 for the other; both 0 until the worker is ready.",
            ("tier", "transport"),
        ),
        Gauge(
            "kvoffload_p2p_leases_held",
            "Leases this instance holds for peers' transfers (pinned host slots).",
            ("tier",),
        ),
        Counter(
            "kvoffload_p2p_refused_messages",
            "Control messages and data-plane connections or requests (reasons data_*: "
            "data_unauthenticated, data_not_granted, data_write, data_flood, ...) this instance "
            "refused, by reason (unauthenticated, bad_mac, malformed, too_large, namespace, "
            "version, reflection, misrouted, identity_collision, ...).",
            ("tier", "reason"),
        ),
        Counter(
            "kvoffload_p2p_refused_routes",
            "Peers named by requests' kv_transfer_params that this instance did not ask, by "
            "reason (not_allowed, malformed, self).",
            ("tier", "reason"),
        ),
        Counter(
            "kvoffload_p2p_refused_connections",
            "Connections to the control port refused or closed before authentication, by reason "
            "(per_source, total, handshake_timeout, wrong_key, mechanism, handshake_failed).",
            ("tier", "reason"),
        ),
        Counter(
            "kvoffload_p2p_failed_handshakes",
            "Handshakes of this instance with its peers that failed, by reason (bad_mac, "
            "reflection, version, timeout, refused_<the peer's reason>, ...).",
            ("tier", "reason"),
        ),
    )

    def __init__(
        self,
        *,
        name: str,
        arena_view: memoryview,
        namespace: Any,
        config: P2PTierConfig,
        arena: Any = None,
    ):
        super().__init__(name=name, arena_view=arena_view, namespace=namespace, config=config)
        if arena is None:
            raise ValueError("type: the p2p tier needs the host arena (build it with create_tier)")
        self.locality = config.locality
        # auth none: "", no CurveZMQ, no proof (allowed only on loopback for trusted users)
        secret = config.shared_secret()
        if secret is None:
            raise ValueError(
                f"secret: the p2p tier needs a shared secret (the secret key, or the "
                f"{config.secret_env} environment variable), or auth: none on a loopback host"
            )
        self._secret = secret.encode()
        self.arena = arena
        self.incarnation = os.urandom(16)
        self._manager: ServedHost | None = None
        self._node: PeerNode | None = None
        self._switch_interval: float | None = None  # held in SWITCH_INTERVAL while it runs
        self._worker: Any = None
        self._server: Any = None
        self._ctx: zmq.Context | None = None
        self.advertise = ""
        # verdicts: key -> the peer that has it READY; keys no peer has (for negative_ttl_s)
        # key -> (the peer that has it, the down sequence number when it was learnt): a peer
        # going down takes the next number, which voids its older entries as they are next read
        # (no scan)
        self._peer_of: LRUCache[bytes, tuple[str, int]] = LRUCache(
            maxsize=config.lookup_cache_entries
        )
        self._downs = _DownLog(MAX_DOWN_LOG)
        self._down_seq = 0
        self._absent: TLRUCache[bytes, float] = TLRUCache(
            maxsize=config.lookup_cache_entries, ttu=lambda k, ttl, now: now + ttl
        )
        self._waiting: dict[bytes, set[str]] = {}
        self._owed: dict[bytes, set[str]] = {}
        self._routes: dict[str, Route] = {}
        self._loads: dict[int, _LoadJob] = {}
        self._pushes: dict[int, JobMetadata] = {}
        # The store jobs held for remote decoders, by job id, oldest first (so also in deadline
        # order: every hold lasts hold_s), and the ids held for each kv_request_id.
        self._holds: OrderedDict[int, _Hold] = OrderedDict()
        self._holds_of: dict[str, set[int]] = {}
        self._finished: list[JobResult] = []
        self._events: list[TierEvent] = []  # chunks peers took from our pushes
        self._peers = tuple(config.peers)
        self._located = bool(config.peer_events)  # the node may know peers beyond the configured
        self._policy = PeerPolicy([*config.peers, *config.peer_events], config.allowed_peers)
        #: Peers requests named that were not asked, by reason (:data:`ROUTE_REFUSALS`).
        self.refused_routes: dict[str, int] = dict.fromkeys(ROUTE_REFUSALS, 0)
        self._route_logged: LRUCache[str, bool] = LRUCache(maxsize=1024)

    # -- start ------------------------------------------------------------------------------------

    def attach(self, manager: ServedHost) -> None:
        """Join ``manager`` (a :class:`~kvoffload.tiering.TieringManager`): start the peer worker,
        the serving role over its host tier, and the node thread."""
        from kvoffload.tiers.p2p.node import WorkerPort
        from kvoffload.tiers.p2p.server import PeerServer
        from kvoffload.tiers.p2p.worker_handle import PeerWorkerHandle
        from kvoffload.workers.p2p_transport import TransportConfig

        cfg = self.config
        self._manager = manager
        self._ctx = zmq.Context()
        # no socket of ours ever waits at close (a context finalized by the GC in some thread
        # would otherwise block there on unsent messages)
        self._ctx.setsockopt(zmq.LINGER, 0)
        self._worker = PeerWorkerHandle(
            self.arena.name,
            TransportConfig(
                kind=cfg.transport,
                host=cfg.data_host
                or (cfg.host if cfg.host not in ("0.0.0.0", "::") else "0.0.0.0"),
                port=cfg.data_port,
                advertise_host=cfg.advertise_host or "",
                deadline_s=cfg.transfer_deadline_s,
            ),
            nice=cfg.worker_nice,
        )
        port = cfg.port + manager.data_parallel_rank if cfg.port else 0
        worker_port = WorkerPort(self._worker)
        self._server = PeerServer(
            manager,
            secret=self._secret,
            incarnation=self.incarnation,
            namespace_id=self.namespace.id(),
            descriptor=lambda: self._worker.descriptor,
            quota_chunks=cfg.quota_chunks,
            heartbeat_s=cfg.heartbeat_s,
            peer_timeout_s=cfg.peer_timeout_s,
            max_lease_s=cfg.lease_ttl_s,
            max_handshakes=cfg.max_handshakes,
            max_handshakes_per_source=cfg.max_handshakes_per_source,
            reachable=lambda ident: self._node.reachable(ident) if self._node else True,
            stale_lease_s=cfg.transfer_deadline_s,
            grants=worker_port.role("server"),
            pull=lambda *a: self._node.pull(*a) if self._node else None,
            on_fetched=lambda kvr, keys: (
                self._node.results.append(Fetched(kvr, keys)) if self._node else None
            ),
        )
        locations = None
        if cfg.peer_events:  # built here, handed to the node thread before it starts
            locations = PeerLocations(
                cfg.peer_events,
                tokens_per_chunk=self.namespace.tokens_per_chunk,
                max_chunks_per_peer=cfg.max_located_chunks,
                replay_timeout_s=cfg.replay_timeout_s,
                where=f"{self.name}.peer_events",
                context=self._ctx,
            )
        bind = f"tcp://{cfg.host}:{port}"
        try:
            node = PeerNode(
                ctx=self._ctx,
                locations=locations,
                server=self._server,
                worker=self._worker,
                bind=bind,
                advertise="",
                incarnation=self.incarnation,
                namespace_id=self.namespace.id(),
                secret=self._secret,
                heartbeat_s=cfg.heartbeat_s,
                peer_timeout_s=cfg.peer_timeout_s,
                transfer_deadline_s=cfg.transfer_deadline_s,
                lease_ttl_s=cfg.lease_ttl_s,
                count=self.count,
                server_free_quota=self._server.free_quota,
                static_peers=self._policy.static,
                request_peer_idle_s=cfg.request_peer_idle_s,
                max_request_peers=cfg.max_request_peers,
                max_half_open=cfg.max_handshakes,
                max_half_open_per_source=cfg.max_handshakes_per_source,
                port=worker_port,
            )
        except zmq.ZMQError as e:
            if locations is not None:
                locations.close()
            raise ConfigError(f"{self.name}.port: cannot bind {bind}: {e}") from None
        self._node = node
        bound_port = int(self._node.bound.rsplit(":", 1)[1])
        self.advertise = f"{cfg.advertise_host or cfg.host}:{bound_port}"
        self._node.advertise = self.advertise
        own = [self.advertise]
        if cfg.host not in ("0.0.0.0", "::"):
            own.append(f"{cfg.host}:{bound_port}")
        self._server.addresses = tuple(dict.fromkeys(own))  # a Hello must have dialed one
        self._policy.own = frozenset(own)
        self._node.start()
        if cfg.engine_switch_interval_s is not None:
            SWITCH_INTERVAL.hold(cfg.engine_switch_interval_s)
            self._switch_interval = cfg.engine_switch_interval_s
        for p in dict.fromkeys([*cfg.peers, *cfg.peer_events]):  # a session confirms its events
            self._node.submit(Connect(p))
        log.info(
            "p2p tier %s: serving on %s (advertised as %s), peers %s",
            self.name,
            self._node.bound,
            self.advertise,
            cfg.peers or "none configured",
        )

    # -- requests ---------------------------------------------------------------------------------

    def on_request(self, req_id: str, kv_transfer_params: Any) -> None:
        """A request arrived with ``kv_transfer_params`` (see the module docstring)."""
        route = parse_route(kv_transfer_params)
        if route is None:
            return
        if route.malformed:
            self._refuse_route(route.malformed, "malformed")
        if route.source is not None:
            node = self._node
            # with auth none a session proves nothing: its advertise address is any local
            # user's claim, so it allows no route
            authenticated = node.authenticated_peers if node is not None and self._secret else ()
            why = self._policy.refusal(route.source, authenticated)
            if why is not None:
                self._refuse_route(route.source, why)
                route.source = None  # remote_prefiller: no other peer either (a miss)
        self._routes[req_id] = route
        if route.source is not None and self._node is not None:
            self._node.submit(Connect(route.source))

    def _refuse_route(self, addr: str, why: str) -> None:
        """A peer a request named is not asked: counted, logged once per address."""
        self.refused_routes[why] = self.refused_routes.get(why, 0) + 1
        if addr not in self._route_logged:
            self._route_logged[addr] = True
            log.warning(
                "p2p tier %s: a request's kv_transfer_params named %r, which is %s; the "
                "request goes on without it (add it to allowed_peers if it is a peer)",
                self.name,
                addr[:128],
                {
                    "not_allowed": "not an allowed peer (peers, peer_events, allowed_peers, or "
                    "a peer authenticated to this instance)",
                    "malformed": "not a host and port",
                    "self": "this instance",
                }.get(why, why),
            )

    def on_request_finished(self, req_id: str) -> None:
        """Forget the request's routing."""
        self._routes.pop(req_id, None)

    def _candidates(self, route: Route | None) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
        """Whom to ask, as ``(head, tail)``: the request's named peer, then (the node puts the
        peers whose KV events show the key in between) the configured peers; ``tail`` None when
        the named peer is the only one to ask (``remote_prefiller``)."""
        if route is not None and route.only:
            return ((route.source,) if route.source is not None else ()), None
        if route is not None and route.source is not None:
            return (route.source,), self._peers
        return (), self._peers

    # -- the engine-thread contract ---------------------------------------------------------------

    @override
    def lookup(self, key: bytes, req_id: str = "") -> LookupResult:
        self._drain()
        if self._holder(key):
            return _HIT
        route = self._routes.get(req_id)
        if route is None and key in self._absent:
            return _MISS
        owed = self._owed.get(key)
        if owed is not None and req_id in owed:
            owed.discard(req_id)
            if not owed:
                del self._owed[key]
            return _MISS
        waiting = self._waiting.get(key)
        if waiting is not None:
            waiting.add(req_id)
            return _RETRY
        head, tail = self._candidates(route)
        if self._node is None or not (head or tail or (tail is not None and self._located)):
            return _MISS
        self._waiting[key] = {req_id}
        # peers' KV events name engine keys: a salted request's tenant key is located by its
        # engine key (only where the events are followed), and asked for as the tenant key
        located_as = self.engine_key_of(key) if self._located and tail is not None else None
        self._node.submit(Probe(key, head, tail, None if located_as == key else located_as))
        return _RETRY

    def origin(self, key: bytes) -> str:
        """The peer (``host:port``) that holds ``key``, as last learnt; empty when none."""
        return self._holder(key)

    def _holder(self, key: bytes) -> str:
        """The peer known to hold ``key`` ("" for none, or one that went down since)."""
        entry = self._peer_of.get(key)
        if entry is None:
            return ""
        peer, learnt = entry
        if self._downs.last(peer) > learnt:  # it went down since
            del self._peer_of[key]
            return ""
        return peer

    def wants_store(self, req_id: str) -> bool:
        """Store jobs this tier takes: a request's chunks held for its remote decoder, and pushes
        (``push``: always, or while the host tier is full)."""
        route = self._routes.get(req_id)
        if route is not None and route.decoder_id:
            return True
        push = self.config.push
        if push == "when_full" and self._manager is not None:
            host = self._manager.host
            if host.num_used < host.num_slots:
                return False
        elif push != "always":
            return False
        node = self._node
        return node is not None and node.client.can_push()

    @override
    def holds_covered(self, req_id: str) -> bool:
        """A prefill request naming a remote decoder: the chunks it found stored are held for
        that decoder as well as those it stores (CASES C49)."""
        route = self._routes.get(req_id)
        return route is not None and bool(route.decoder_id)

    @override
    def submit_store(self, job: JobMetadata) -> None:
        route = self._routes.get(job.req_id)
        if route is not None and route.decoder_id:
            kvr = route.decoder_id
            self._holds[job.job_id] = _Hold(kvr, job, time.monotonic() + self.config.hold_s)
            self._holds_of.setdefault(kvr, set()).add(job.job_id)
            return
        if self._node is None or self.config.push == "off":
            self._finished.append(
                JobResult(
                    job_id=job.job_id,
                    success=False,
                    reason="not_routed",
                    failed=dict.fromkeys(job.keys, "rejected"),
                )
            )
            return
        self._pushes[job.job_id] = job
        self._node.submit(Push(job.job_id, list(job.keys), list(job.slots)))

    @override
    def submit_load(self, job: JobMetadata) -> None:
        by_peer: dict[str, tuple[list[bytes], list[int]]] = {}
        missing = {}
        for key, slot in zip(job.keys, job.slots):
            peer = self._holder(key)
            if not peer:
                missing[key] = "missing"
                continue
            keys, slots = by_peer.setdefault(peer, ([], []))
            keys.append(key)
            slots.append(slot)
        lj = _LoadJob(job, len(by_peer))
        lj.failed.update(missing)
        route = self._routes.get(job.req_id)
        kvr = route.kv_request_id if route is not None else ""
        if not by_peer or self._node is None:
            self._finish_load(lj)
            return
        self._loads[job.job_id] = lj
        for peer, (keys, slots) in by_peer.items():
            self._node.submit(Load(job.job_id, peer, keys, slots, kvr))

    def _finish_load(self, lj: _LoadJob) -> None:
        self._loads.pop(lj.meta.job_id, None)
        ttl = self.config.failed_load_ttl_s
        for key, why in lj.failed.items():
            if why == "busy":  # the peer leased no more slots then: it may still hold the key
                continue
            self._peer_of.pop(key, None)
            if ttl > 0:
                self._absent[key] = ttl
        if lj.failed:
            reasons: dict[str, int] = {}
            for r in lj.failed.values():
                reasons[r] = reasons.get(r, 0) + 1
            res = JobResult(
                job_id=lj.meta.job_id,
                success=False,
                successful_keys=lj.ok,
                reason=" ".join(f"{r}={n}" for r, n in sorted(reasons.items())),
                failed=lj.failed,
                transfer_bytes=lj.nbytes,
                transfer_seconds=time.monotonic() - lj.t0,
            )
        else:
            res = JobResult(
                job_id=lj.meta.job_id,
                success=True,
                transfer_bytes=lj.nbytes,
                transfer_seconds=time.monotonic() - lj.t0,
            )
        self._finished.append(res)

    def _drain(self) -> None:
        """Apply what the node thread reported."""
        node = self._node
        if node is None or not node.results:
            return
        results = node.results
        while results:
            r = results.popleft()
            match r:
                case Verdict():
                    key, peer = r.key, r.peer
                    waiting = self._waiting.pop(key, None)
                    if peer is not None:
                        self._peer_of[key] = (peer, self._down_seq)
                        self._absent.pop(key, None)
                    else:
                        if self.config.negative_ttl_s > 0:
                            self._absent[key] = self.config.negative_ttl_s
                        if waiting:
                            self._owed.setdefault(key, set()).update(waiting)
                case LoadDone():
                    lj = self._loads.get(r.job_id)
                    if lj is None:
                        continue
                    lj.ok.extend(r.ok)
                    lj.failed.update(r.failed)
                    lj.nbytes += r.nbytes
                    lj.parts -= 1
                    if lj.parts == 0:
                        self._finish_load(lj)
                case PushDone():
                    meta = self._pushes.pop(r.job_id, None)
                    if meta is None:
                        continue
                    if r.peer is not None:
                        for k in r.ok:
                            self._peer_of[k] = (r.peer, self._down_seq)
                        if r.ok and self.record_events:  # held at a peer now: medium PEER
                            self._events.append(TierEvent(list(r.ok), False))
                    pulled = len(r.ok) * self.arena.row_bytes  # the rows the peer read
                    self._finished.append(
                        JobResult(
                            job_id=r.job_id,
                            success=False,
                            successful_keys=r.ok,
                            failed=r.failed,
                            transfer_bytes=pulled,
                        )
                        if r.failed
                        else JobResult(job_id=r.job_id, success=True, transfer_bytes=pulled)
                    )
                case PeerDown():
                    self._down_seq += 1
                    self._downs[r.peer] = self._down_seq
                case Fetched():
                    self._fetched(r.kv_request_id, set(r.keys))

    def _fetched(self, kvr: str, keys: set[bytes]) -> None:
        """The decoder of ``kvr`` has read ``keys`` (one of its leases ended): a held job whose
        every key has been read ends."""
        for job_id in list(self._holds_of.get(kvr, ())):
            hold = self._holds[job_id]
            hold.fetched.update(k for k in hold.meta.keys if k in keys)
            if len(hold.fetched) == len(set(hold.meta.keys)):
                self._end_hold(job_id)
                read = len(hold.fetched) * self.arena.row_bytes  # the rows the decoder read
                self._finished.append(JobResult(job_id=job_id, success=True, transfer_bytes=read))

    def _end_hold(self, job_id: int) -> _Hold:
        """Forget the held job ``job_id``; its result is the caller's to give."""
        hold = self._holds.pop(job_id)
        ids = self._holds_of[hold.kvr]
        ids.discard(job_id)
        if not ids:
            del self._holds_of[hold.kvr]
        return hold

    def _unfetched(self, hold: _Hold, reason: str) -> JobResult:
        """The result of a held job that ends before its decoder read all of it: the keys it
        read succeeded, the others failed ``reason``."""
        fetched, keys = hold.fetched, hold.meta.keys
        return JobResult(
            job_id=hold.meta.job_id,
            success=False,
            successful_keys=[k for k in keys if k in fetched],
            reason=reason,
            failed={k: reason for k in keys if k not in fetched},
            transfer_bytes=len(fetched) * self.arena.row_bytes,
        )

    def _expire_holds(self, now: float | None) -> None:
        """End the held jobs past their deadline (all of them with ``now`` None), oldest first:
        the keys the decoder read succeeded, the others failed ``not_fetched``."""
        holds = self._holds
        while holds:
            job_id, hold = next(iter(holds.items()))
            if now is not None and hold.deadline > now:
                return  # the others are younger
            self._end_hold(job_id)
            self._finished.append(self._unfetched(hold, "not_fetched"))

    @override
    def yield_pins(self, num_chunks: int, req_id: str) -> list[JobResult]:
        """A store held for ``req_id``'s remote decoder that does not fit the pin budget takes
        the place of holds of other decoders that none has begun to read, oldest first (they
        fail ``hold_displaced``). A hold being read, or one of the same decoder, is never given
        up; nothing is yielded for a store that is not a hold (a push)."""
        route = self._routes.get(req_id)
        if route is None or not route.decoder_id or not self._holds:
            return []
        out: list[JobResult] = []
        freed = 0
        for job_id, hold in list(self._holds.items()):
            if freed >= num_chunks:
                break
            if hold.fetched or hold.kvr == route.decoder_id:
                continue
            self._end_hold(job_id)
            out.append(self._unfetched(hold, "hold_displaced"))
            freed += len(hold.meta.keys)
        return out

    @override
    def get_finished_jobs(self) -> list[JobResult]:
        self._drain()
        if self._holds:
            self._expire_holds(time.monotonic())
        out, self._finished = self._finished, []
        return out

    @override
    def take_events(self) -> list[TierEvent]:
        """Chunks peers pulled from this tier's pushes, as their results were applied since the
        last call (no removals: a peer evicts them unseen)."""
        out, self._events = self._events, []
        return out

    @override
    def has_pending_work(self) -> bool:
        return bool(self._waiting or self._loads or self._pushes or self._holds or self._finished)

    @override
    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._node is not None and self._node.results:
                return True
            time.sleep(0.001)
        return False

    @override
    def workers_ready(self) -> bool:
        return self._worker is not None and self._worker.descriptor is not None

    _STATS = (
        ("load_bytes", "kvoffload_p2p_bytes", ("load",)),
        ("push_bytes", "kvoffload_p2p_bytes", ("push",)),
        ("load_chunks", "kvoffload_p2p_chunks", ("load", "ok")),
        ("load_failed_chunks", "kvoffload_p2p_chunks", ("load", "failed")),
        ("push_chunks", "kvoffload_p2p_chunks", ("push", "ok")),
        ("lookup_chunks", "kvoffload_p2p_lookups", ("asked",)),
        ("lookup_hits", "kvoffload_p2p_lookups", ("hit",)),
    )

    @override
    def report_metrics(self, metrics: MetricSet) -> None:
        node = self._node
        if node is None:
            return
        name = self.name
        client = node.client
        stats = dict(client.peer_stats)
        links = list(client.links.values())
        # each peer known has every counter, at 0 until counted (rate() sees the first)
        peers = {link.label for link in links}.union(peer for peer, _ in stats)
        for stat, metric, labels in self._STATS:
            for peer in peers:
                metrics.set_total(metric, stats.get((peer, stat), 0), name, peer, *labels)
        lat = client.latencies
        while lat:
            peer, secs = lat.popleft()
            metrics.observe("kvoffload_p2p_load_latency_seconds", secs, name, peer)
        for link in links:
            metrics.set("kvoffload_p2p_peer_up", 1 if link.up else 0, name, link.label)
        running = node.worker.kind
        for kind in ("nixl", "tcp"):
            metrics.set("kvoffload_p2p_transport", 1 if kind == running else 0, name, kind)
        counters = node.server_counters  # a snapshot the node thread takes
        metrics.set("kvoffload_p2p_leases_held", counters.get("leases_held", 0), name)
        for k, v in counters.items():
            if k.startswith("refused."):
                metrics.set_total("kvoffload_p2p_refused_messages", v, name, k[8:])
        for reason, v in list(self.refused_routes.items()):
            metrics.set_total("kvoffload_p2p_refused_routes", v, name, reason)
        for reason, v in list(node.refused_connections.items()):
            metrics.set_total("kvoffload_p2p_refused_connections", v, name, reason)
        for reason, v in list(client.handshake_failures.items()):
            metrics.set_total("kvoffload_p2p_failed_handshakes", v, name, reason)

    @property
    def worker_pid(self) -> int | None:
        """The peer worker process's pid (None before :meth:`attach` or after shutdown)."""
        return None if self._worker is None else self._worker.pid

    def peers_up(self) -> list[str]:
        """The peers whose session is authenticated and live now (read from the node thread's
        state: a snapshot)."""
        node = self._node
        if node is None:
            return []
        return node.client.peers_up()

    @override
    def shutdown(self) -> None:
        node, self._node = self._node, None
        if self._switch_interval is not None:
            SWITCH_INTERVAL.release(self._switch_interval)
            self._switch_interval = None
        stuck = False
        if node is not None:
            node.stop()
            stuck = node.is_alive()
            if stuck:  # its sockets are still open: terminating the context would hang
                frame = sys._current_frames().get(node.ident or -1)
                where = "".join(traceback.format_stack(frame)) if frame is not None else "?"
                log.error(
                    "p2p tier %s: the node thread did not stop; its sockets leak. It is at:\n%s",
                    self.name,
                    where,
                )
        if self._worker is not None:
            if not stuck:  # the handle belongs to the node thread while it runs
                self._worker.close()
            elif self._worker.pid is not None:  # no process outlives the tier, stuck or not
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._worker.pid, signal.SIGKILL)
            self._worker = None
        if self._ctx is not None:
            if not stuck:
                self._ctx.term()
            else:
                # Never let the GC finalize it: pyzmq's Context.__del__ would destroy() it from
                # whatever thread allocates next (another tier's node thread, say) and block
                # there on the sockets the stuck thread still holds.
                _STUCK_CONTEXTS.append(self._ctx)
            self._ctx = None
        for lj in list(self._loads.values()):
            lj.failed.update({k: "cancelled" for k in lj.meta.keys if k not in set(lj.ok)})
            self._finish_load(lj)
        for meta in self._pushes.values():
            self._finished.append(
                JobResult(
                    job_id=meta.job_id,
                    success=False,
                    reason="cancelled",
                    failed=dict.fromkeys(meta.keys, "cancelled"),
                )
            )
        self._pushes.clear()
        self._expire_holds(None)
