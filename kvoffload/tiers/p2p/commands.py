"""The typed commands and results the p2p tier's engine thread and node thread exchange.

::

    engine thread (P2PTier)                              node thread (PeerNode, its PeerClient)
      lookup: unknown key ── Probe(key, head, tail, ...) ─▶ Lookup at each peer in turn
      submit_load ────────── Load(job_id, peer, keys, ...) ▶ Lease, READ, Release (in parts)
      submit_store ───────── Push(job_id, keys, slots) ───▶ Offer to the peer with most quota
      attach, on_request ─── Connect(peer) ───────────────▶ open that peer's session now
                    commands: a deque, then a byte on the wake-up pipe
      _drain ◀── Verdict(key, peer | None) ─────────────── the first peer with it READY, or none
             ◀── LoadDone(job_id, ok, failed, ...) ──────── one per Load, once every part ended
             ◀── PushDone(job_id, peer, ok, failed) ─────── one per Push
             ◀── PeerDown(peer) ─────────────────────────── drop every verdict naming that peer
             ◀── Fetched(kv_request_id, keys) ───────────── (serving role) a decoder released
                    results: a deque, drained at the engine's next lookup or step

Each direction is one :class:`collections.deque`: ``append`` and ``popleft`` are atomic, so neither
thread locks, and neither touches the other's state. A command carries everything the node needs
(no reference back into the engine's tables); a result carries everything the engine applies. The
structs are frozen and untracked by the garbage collector (``gc=False``: they hold only bytes,
strings, numbers and plain containers of them), so sending one costs one small allocation, as the
tuples they replace did.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "Command",
    "Connect",
    "Fetched",
    "Load",
    "LoadDone",
    "PeerDown",
    "Probe",
    "Push",
    "PushDone",
    "Result",
    "Verdict",
]


# -- engine -> node ---------------------------------------------------------------------------


class Probe(msgspec.Struct, frozen=True, gc=False):
    """Which peer has ``key`` READY? Answered by one :class:`Verdict`.

    Attributes:
        key: the chunk key, as peers hold it and are asked for it (a tenant key for a salted
            request's chunk).
        head: peers to ask first, in order (the request's named peer).
        tail: peers to ask after ``head`` and after the peers whose KV events show the key
            (the configured ``peers``); None: ask ``head`` only (``remote_prefiller``).
        located_as: the key the KV-event locations are asked with: the engine's key of a
            tenant key (peers' events name engine keys); None: ``key``. Never sent to a peer.
    """

    key: bytes
    head: tuple[str, ...]
    tail: tuple[str, ...] | None
    located_as: bytes | None = None


class Load(msgspec.Struct, frozen=True, gc=False):
    """Read ``keys`` from ``peer`` into the reserved host ``slots`` (one per key). Answered by
    one :class:`LoadDone`.

    Attributes:
        job_id: the load job (one job may send one Load per peer).
        peer: ``host:port`` of the peer that answered READY.
        keys, slots: the chunks and the local host slots they go to.
        kv_request_id: the orchestrator's id of the transfer (``remote_prefiller``), or "".
    """

    job_id: int
    peer: str
    keys: list[bytes]
    slots: list[int]
    kv_request_id: str


class Push(msgspec.Struct, frozen=True, gc=False):
    """Offer ``keys`` (pinned in host ``slots`` until answered) to the peer with the most free
    quota. Answered by one :class:`PushDone`."""

    job_id: int
    keys: list[bytes]
    slots: list[int]


class Connect(msgspec.Struct, frozen=True, gc=False):
    """Open the session with ``peer`` (``host:port``) now, if not open yet."""

    peer: str


Command = Probe | Load | Push | Connect
"""A command of the engine thread to the node thread."""


# -- node -> engine ---------------------------------------------------------------------------


class Verdict(msgspec.Struct, frozen=True, gc=False):
    """Where ``key`` is: ``peer`` has it READY, or (None) no peer asked has it."""

    key: bytes
    peer: str | None


class LoadDone(msgspec.Struct, frozen=True, gc=False):
    """The end of one :class:`Load`.

    Attributes:
        job_id: the Load's job.
        ok: its keys now in their host slots.
        failed: every other key of the Load -> why (``missing``, ``busy``, ``peer_down``,
            ``timeout``, ``bad_reply``, a transfer's reason...).
        nbytes: bytes read.
        seconds: from the Load's arrival at the node to its end.
    """

    job_id: int
    ok: list[bytes]
    failed: dict[bytes, str]
    nbytes: int
    seconds: float


class PushDone(msgspec.Struct, frozen=True, gc=False):
    """The end of one :class:`Push`: ``peer`` (None when none took it) now holds ``ok``;
    ``failed``: every other key -> why (``no_peer``, ``refused``, ``timeout``, ``bad_reply``)."""

    job_id: int
    peer: str | None
    ok: list[bytes]
    failed: dict[bytes, str]


class PeerDown(msgspec.Struct, frozen=True, gc=False):
    """``peer`` went down or restarted: every verdict naming it is void."""

    peer: str


class Fetched(msgspec.Struct, frozen=True, gc=False):
    """A decoder released a lease naming ``kv_request_id``: it has read ``keys`` (the serving
    role reports it; the tier ends the holds of that request)."""

    kv_request_id: str
    keys: list[bytes]


Result = Verdict | LoadDone | PushDone | PeerDown | Fetched
"""A result of the node thread for the engine thread."""
