"""The p2p tier's control protocol between instances: msgspec tagged structs, msgpack-encoded, one ZMQ
frame per message (client DEALER → server ROUTER; the server may also send to a client unasked).

::

    ── with auth: secret, every control socket runs CurveZMQ under a keypair derived from the
       shared secret (:func:`curve_keypair`): a party without the secret completes no ZMQ
       handshake, and everything below is encrypted and authenticated end to end ──
    client ──Hello(version, incarnation, advertise, dialed, namespace_id, nonce)──▶ server
    client ◀──Challenge(version, incarnation, advertise, nonce, mac "server")─────── server  proves
    client ──Auth(mac "client", descriptor)───────────────────────────────────────▶ server  proves
    client ◀──Welcome(descriptor, heartbeat_s, quota_chunks, data_token, mac "welcome")── server  binds
              | Refused(reason)
    ── authenticated from here; transport descriptors and the session's data token cross only
       after the other side proved ──
    Lookup(req, keys)                    ◀▶ LookupReply(req, states)   one byte per key (MISS/READY/PENDING)
    Lease(req, keys, ttl_s, kv_request_id) ◀▶ LeaseReply(req, lease, slots, ttl_s, digests)
                                              slot -1: not leasable, -2: lease cap reached;
                                              ttl_s: the lifetime granted; a digest per slot
    Release(lease)                                                      no reply
    Offer(req, keys, lease, slots, ttl_s, digests) ◀▶ OfferReply(req, accepted)   a push: the
                                                                        receiver pulls
    Pulled(lease, ok)                    (receiver → pusher) its reads of that lease have settled
    Heartbeat(seq, free_quota)           ◀▶ HeartbeatAck(seq, free_quota)   either side

**The handshake's MACs** (:func:`handshake_mac`, HMAC-SHA256 under :func:`transcript_key`) each
cover the whole transcript so far: every message of the handshake as encoded, the one being sent
with its ``mac`` zeroed, so every field of each (versions, both incarnations, both advertise
addresses, the address the client dialed, both nonces, the namespace, both descriptors and
whatever is added to Auth or Welcome later) is bound to this one session, and each MAC names its
role (``server``, ``client``, ``welcome``) so none stands in for another. The server refuses a Hello
of another version (no downgrade), of another namespace, carrying its own incarnation (a
reflection) or naming a dialed address that is not its own (a relay or a misroute); the client
refuses a Challenge of another version or carrying its own incarnation. Each side checks the
other's MAC before it uses anything the other sent, and sends its descriptor only after the other
proved the secret.

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
import zmq
from zmq.utils import z85

PROTOCOL_VERSION = 3
"""Bumped on any incompatible change; a Hello or Challenge of another version is refused (2: CurveZMQ,
the dialed address, whole-transcript MACs; 3: the session's data token in Welcome, granted lifetimes
and digests in LeaseReply and Offer)."""

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
ZERO_MAC = bytes(MAC_BYTES)
"""What a message's own ``mac`` field holds while its MAC is computed (:func:`handshake_mac`)."""
CURVE_OVERHEAD_BYTES = 64
"""Bytes CurveZMQ adds to a message on the wire (its MESSAGE command: 33); the sockets' ``MAXMSGSIZE``
is :data:`MAX_MESSAGE_BYTES` plus this."""

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
        dialed: the address (``host:port``) the client connected to; the server refuses one that
            is not its own (a relay, or a misroute).
        namespace_id: hex id of the namespace whose chunks the session reads and offers.
        nonce: 32 random bytes the server's MAC must cover.
    """

    version: int
    incarnation: _Incarnation
    advertise: _Short
    dialed: _Short
    namespace_id: _Short
    nonce: _Nonce


class Challenge(_Msg, tag="challenge"):
    """Server → client: the server's identity and its proof of the secret over the transcript so
    far (:func:`handshake_mac`, role ``server``, over the Hello and this Challenge).

    Attributes:
        version: :data:`PROTOCOL_VERSION` of the server.
        incarnation: the server instance's identity for this start.
        advertise: where the server says it is reached (``host:port``).
        nonce: 32 random bytes.
        mac: the server's MAC.
    """

    version: int
    incarnation: _Incarnation
    advertise: _Short
    nonce: _Nonce
    mac: _Mac


class Auth(_Msg, tag="auth"):
    """Client → server: the client's proof (:func:`handshake_mac`, role ``client``, over Hello,
    Challenge and this Auth, so its descriptor too) and its transport descriptor (opaque bytes,
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
        mac: :func:`handshake_mac`, role ``welcome``, over the whole handshake and this Welcome
            with ``mac`` zeroed: every field of it, any field added later included, is covered;
            the client checks it before it uses the descriptor.
    """

    descriptor: Annotated[bytes, msgspec.Meta(max_length=MAX_MESSAGE_BYTES // 2)]
    heartbeat_s: _Seconds
    quota_chunks: _Count
    data_token: _Token
    mac: _Mac


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


class _HelloVersion(msgspec.Struct, array_like=True, tag="hello"):
    version: int


_version_decoder = msgspec.msgpack.Decoder(_HelloVersion)


def hello_version(frame: bytes | memoryview) -> int | None:
    """The ``version`` of a frame that is a Hello of any protocol version (its first field since
    version 1), or None: so that a Hello of another version is refused as ``version``, not as
    malformed. Call only on frames :func:`decode` refused (size already checked)."""
    try:
        return _version_decoder.decode(frame).version
    except msgspec.DecodeError:
        return None


# -- keys ----------------------------------------------------------------------------------------

KDF_SALT = b"kvoffload p2p v2"
"""HKDF salt of every key derived from the shared secret (:func:`derive_key`)."""


def derive_key(secret: bytes, purpose: str) -> bytes:
    """32 bytes for ``purpose`` from the shared ``secret``: HKDF-SHA256 (RFC 5869), extract with
    salt :data:`KDF_SALT`, expand with info ``purpose`` (one block). Distinct purposes give
    independent keys, so the secret itself never keys anything."""
    prk = hmac.new(KDF_SALT, secret, hashlib.sha256).digest()
    return hmac.new(prk, purpose.encode() + b"\x01", hashlib.sha256).digest()


def transcript_key(secret: bytes) -> bytes:
    """The key of the handshake's MACs (:func:`handshake_mac`)."""
    return derive_key(secret, "transcript mac")


def curve_keypair(secret: bytes) -> tuple[bytes, bytes]:
    """``(public, secret)`` Z85-encoded: the CurveZMQ long-term keypair every instance that knows
    ``secret`` shares (the Curve25519 secret key is :func:`derive_key` ``"curve secret key"``).
    Servers run with it and admit only clients proving it (their ZAP handler), and clients
    expect it of the server: both ends prove knowledge of the secret before a byte of the
    protocol crosses, and a listener that does not know it completes no ZMQ handshake."""
    sk = z85.encode(derive_key(secret, "curve secret key"))
    return zmq.curve_public(sk), sk


# -- MACs ---------------------------------------------------------------------------------------


def _unmacked(msg: PeerMessage) -> bytes:
    if isinstance(msg, (Challenge, Auth, Welcome)):
        msg = msgspec.structs.replace(msg, mac=ZERO_MAC)
    return encode(msg)


def handshake_mac(key: bytes, role: str, *transcript: PeerMessage) -> bytes:
    """HMAC-SHA256 under ``key`` (:func:`transcript_key`) over ``role`` and the ``transcript``:
    each message encoded (:func:`encode`, so every field counts), length-prefixed, the last one
    (the message the MAC goes into) with its ``mac`` field zeroed (:data:`ZERO_MAC`).

    The server's Challenge MAC is role ``"server"`` over (Hello, Challenge); the client's Auth
    ``"client"`` over (Hello, Challenge, Auth); the server's Welcome ``"welcome"`` over (Hello,
    Challenge, Auth, Welcome). Compare with :func:`mac_ok`.
    """
    h = hmac.new(key, b"kvoffload p2p handshake " + role.encode(), hashlib.sha256)
    last = len(transcript) - 1
    for i, msg in enumerate(transcript):
        part = _unmacked(msg) if i == last else encode(msg)
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


def mac_ok(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison of two MACs."""
    return hmac.compare_digest(expected, got)
