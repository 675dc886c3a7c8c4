"""The p2p tier's control protocol between instances: msgspec tagged structs, msgpack-encoded, one ZMQ
frame per message (client DEALER → server ROUTER; the server may also send to a client unasked).

::

    client ──Hello(version, incarnation, advertise, namespace_id, nonce)─────────▶ server
    client ◀──Challenge(incarnation, nonce, mac = HMAC(secret, "server" ...))──── server   proves the secret
    client ──Auth(mac = HMAC(secret, "client" ...), descriptor)─────────────────▶ server   proves it back
    client ◀──Welcome(descriptor, heartbeat_s, quota_chunks, data_token) | Refused(reason)── server
    ── authenticated from here; transport descriptors and the session's data token have now
       crossed, never before ──
    Lookup(req, keys)                    ◀▶ LookupReply(req, states)   one byte per key (MISS/READY/PENDING)
    Lease(req, keys, ttl_s, kv_request_id) ◀▶ LeaseReply(req, lease, slots, ttl_s, digests)
                                              slot -1: not leasable, -2: lease cap reached;
                                              ttl_s: the lifetime granted; a digest per slot
    Release(lease)                                                      no reply
    Offer(req, keys, lease, slots, ttl_s, digests) ◀▶ OfferReply(req, accepted)   a push: the
                                                                        receiver pulls
    Pulled(lease, ok)                    (receiver → pusher) its reads of that lease have settled
    Heartbeat(seq, free_quota)           ◀▶ HeartbeatAck(seq, free_quota)   either side

Bytes move on the data plane (``kvoffload.workers.p2p_transport``), never here: a session's data
connections prove its ``data_token``, and read only the slots its leases (or a pusher's offers)
grant, while they live; every chunk read is checked against the digest in the LeaseReply or Offer,
taken by the serving side when it granted the slots (:data:`DIGEST_BYTES` each, concatenated in slot
order; zeros for a slot not leased).

The namespace is fixed per session by ``Hello.namespace_id``: a session reads and offers only chunks of
exactly that namespace. Every message is size-checked before it is decoded (:func:`decode`), and lists
are bounded (:data:`MAX_KEYS`), so a hostile or broken peer costs one counted refusal, never memory or a
crash.

Imports nothing of the project (``kvoffload.ipc`` is the bottom layer).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

import msgspec

PROTOCOL_VERSION = 2
"""Bumped on any incompatible change; a Hello of another version is refused. 2: the session's data
token (Welcome), granted lifetimes and digests (LeaseReply, Offer)."""

MAX_MESSAGE_BYTES = 1 << 20
"""Largest control message accepted (bytes): a batch of :data:`MAX_KEYS` 32-byte keys fits easily."""

MAX_KEYS = 4096
"""Most chunk keys in one Lookup, Lease or Offer."""

MAX_KEY_BYTES = 64
"""Longest chunk key (bytes): kvoffload keys are 32–40 bytes."""

NONCE_BYTES = 32
TOKEN_BYTES = 32
"""A session's data token (``Welcome.data_token``): random, one per session."""
DIGEST_BYTES = 16
"""One chunk's digest (xxh3-128, ``kvoffload.workers.p2p_transport.chunk_digest``)."""
INCARNATION_BYTES = 16
MAC_BYTES = 32  # HMAC-SHA256

LEASE_BUSY = -2
"""A LeaseReply slot: not leased now because the server's cap on leased slots is reached (ask
again later; says nothing of the key). -1: not leasable (absent, or not READY)."""

# Lookup states, one byte per key in LookupReply.states.
MISS = 0
READY = 1  # in the serving instance's host tier, readable now: lease it
PENDING = (
    2  # being written, or being promoted from the serving instance's own fs/obj tier: ask again
)

_Key = Annotated[bytes, msgspec.Meta(max_length=MAX_KEY_BYTES)]
_Keys = Annotated[list[_Key], msgspec.Meta(max_length=MAX_KEYS)]
_Slots = Annotated[list[int], msgspec.Meta(max_length=MAX_KEYS)]
_Short = Annotated[str, msgspec.Meta(max_length=256)]
_Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
_Mac = Annotated[bytes, msgspec.Meta(min_length=MAC_BYTES, max_length=MAC_BYTES)]
_Incarnation = Annotated[
    bytes, msgspec.Meta(min_length=INCARNATION_BYTES, max_length=INCARNATION_BYTES)
]
_Seconds = Annotated[float, msgspec.Meta(ge=0, le=86400)]
_Token = Annotated[bytes, msgspec.Meta(min_length=TOKEN_BYTES, max_length=TOKEN_BYTES)]
_Digests = Annotated[bytes, msgspec.Meta(max_length=MAX_KEYS * DIGEST_BYTES)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
_Id = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


class _Msg(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    pass


class Hello(_Msg, tag="hello"):
    """Client → server, first message of a session.

    Attributes:
        version: :data:`PROTOCOL_VERSION` of the client.
        incarnation: the client instance's identity for this start (16 random bytes, new per start).
        advertise: where the client's own p2p tier listens (``host:port``), so the server can name it.
        namespace_id: hex id of the namespace whose chunks the session reads and offers.
        nonce: 32 random bytes the server's MAC must cover.
    """

    version: int
    incarnation: _Incarnation
    advertise: _Short
    namespace_id: _Short
    nonce: _Nonce


class Challenge(_Msg, tag="challenge"):
    """Server → client: the server's identity and proof that it knows the secret (:func:`mac`)."""

    incarnation: _Incarnation
    nonce: _Nonce
    mac: _Mac


class Auth(_Msg, tag="auth"):
    """Client → server: the client's proof (:func:`mac`) and its transport descriptor (opaque bytes,
    :mod:`kvoffload.workers.p2p_transport`; sent only now, after the server proved the secret)."""

    mac: _Mac
    descriptor: Annotated[bytes, msgspec.Meta(max_length=MAX_MESSAGE_BYTES // 2)]


class Welcome(_Msg, tag="welcome"):
    """Server → client: the session is authenticated.

    Attributes:
        descriptor: the server's transport descriptor.
        heartbeat_s: how often the server expects a heartbeat (seconds).
        quota_chunks: chunks the server admits from this client's offers now (0: it takes no pushes).
        data_token: the session's data token (:data:`TOKEN_BYTES` random bytes): data connections
            of either side prove it (challenge-response; it never crosses the data plane), and
            read only what the other side granted this session.
    """

    descriptor: Annotated[bytes, msgspec.Meta(max_length=MAX_MESSAGE_BYTES // 2)]
    heartbeat_s: _Seconds
    quota_chunks: _Count
    data_token: _Token


class Refused(_Msg, tag="refused"):
    """Either way: the message (or the whole session) is refused; ``reason`` says why."""

    reason: _Short


class Lookup(_Msg, tag="lookup"):
    """Which of ``keys`` does the server hold? Never pins anything."""

    req: _Id
    keys: _Keys


class LookupReply(_Msg, tag="lookup_reply"):
    """One state byte per key of the Lookup (:data:`MISS`, :data:`READY`, :data:`PENDING`)."""

    req: _Id
    states: Annotated[bytes, msgspec.Meta(max_length=MAX_KEYS)]


class Lease(_Msg, tag="lease"):
    """Pin ``keys`` in the server's host tier for one transfer, for at most ``ttl_s`` seconds (the
    server grants at most its own ``lease_ttl_s``, and bounds each peer's share of its leases).

    ``kv_request_id``: the orchestrator's id when the transfer is a decoder fetching a prefill's
    chunks (``remote_prefiller``), so the server can end what it holds for that decoder; else empty.
    """

    req: _Id
    keys: _Keys
    ttl_s: _Seconds
    kv_request_id: _Short = ""


class LeaseReply(_Msg, tag="lease_reply"):
    """The lease id and one host slot per key (-1: not leasable: absent or not READY;
    :data:`LEASE_BUSY`: the server leases no more slots now).

    ``ttl_s``: the lease's lifetime left when it was granted (seconds): the reader's transfer must be
    over before ``ttl_s`` has passed since it sent the Lease (less a margin), else the slots may
    have been reused. ``digests``: :data:`DIGEST_BYTES` per slot, taken when the slots were
    granted (zeros for a slot not leased); a chunk read that does not match is not served."""

    req: _Id
    lease: _Id
    slots: _Slots
    ttl_s: _Seconds
    digests: _Digests


class Release(_Msg, tag="release"):
    """The transfers of ``lease`` have settled: drop its pins (no reply)."""

    lease: _Id


class Offer(_Msg, tag="offer"):
    """A push: the sender holds ``keys`` pinned in its own ``slots`` (``lease``: the push's id) and
    granted them to this session for ``ttl_s`` seconds; it asks the receiver to pull them. The
    receiver reads them itself, so nothing ever writes into another instance's memory, and checks
    each against ``digests`` (:data:`DIGEST_BYTES` per key, taken when the sender granted them)."""

    req: _Id
    keys: _Keys
    lease: _Id
    slots: _Slots
    ttl_s: _Seconds
    digests: _Digests


class OfferReply(_Msg, tag="offer_reply"):
    """One byte per offered key: 1 the receiver admitted it (it will pull it), 0 not."""

    req: _Id
    accepted: Annotated[bytes, msgspec.Meta(max_length=MAX_KEYS)]


class Pulled(_Msg, tag="pulled"):
    """Receiver → pusher: its reads of ``lease`` have settled; ``ok`` one byte per offered key (1 the
    receiver now holds it). The pusher releases its lease."""

    lease: _Id
    ok: Annotated[bytes, msgspec.Meta(max_length=MAX_KEYS)]


class Heartbeat(_Msg, tag="heartbeat"):
    """Either way: still here. ``free_quota``: chunks the sender would admit from offers now."""

    seq: _Id
    free_quota: _Count


class HeartbeatAck(_Msg, tag="heartbeat_ack"):
    """The answer to a :class:`Heartbeat`."""

    seq: _Id
    free_quota: _Count


PeerMessage = (
    Hello
    | Challenge
    | Auth
    | Welcome
    | Refused
    | Lookup
    | LookupReply
    | Lease
    | LeaseReply
    | Release
    | Offer
    | OfferReply
    | Pulled
    | Heartbeat
    | HeartbeatAck
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(PeerMessage)


class BadMessage(ValueError):
    """A control message that is too large, not msgpack, or not one of :data:`PeerMessage`."""


def encode(msg: PeerMessage) -> bytes:
    """One message as msgpack bytes."""
    return _encoder.encode(msg)


def decode(frame: bytes | memoryview) -> PeerMessage:
    """Decode one frame, refusing it before decoding when larger than :data:`MAX_MESSAGE_BYTES`.

    Raises:
        BadMessage: too large, malformed, or failing the schema (a bound, a type, an unknown tag).
    """
    if len(frame) > MAX_MESSAGE_BYTES:
        raise BadMessage(f"{len(frame)} bytes, more than the {MAX_MESSAGE_BYTES} allowed")
    try:
        return _decoder.decode(frame)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise BadMessage(str(e)) from None


def mac(secret: bytes, role: str, *parts: bytes) -> bytes:
    """HMAC-SHA256 over ``role`` and ``parts`` (each length-prefixed, so no two part lists collide).

    The server's Challenge MAC uses role ``"server"`` over (client nonce, server nonce, client
    incarnation, server incarnation, namespace id); the client's Auth MAC role ``"client"`` over the
    same parts. Compare with :func:`hmac.compare_digest` (:func:`mac_ok`).
    """
    h = hmac.new(secret, role.encode(), hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(4, "little"))
        h.update(p)
    return h.digest()


def mac_ok(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison of two MACs."""
    return hmac.compare_digest(expected, got)
