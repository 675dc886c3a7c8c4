"""The p2p tier's settings (``{"type": "p2p", ...}``) and their checks.

:class:`P2PTierConfig`, :func:`parse_peer` (a peer's ``host:port``) and :data:`SECRET_ENV`.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from kvoffload.config import Positive
from kvoffload.tiers.p2p.locations import event_sources
from kvoffload.tiers.process import Seconds, TTLSeconds
from kvoffload.validation import raise_problems

SECRET_ENV = "KVOFFLOAD_P2P_SECRET"
"""The environment variable the shared secret is read from by default (``secret_env``)."""
_Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]


def parse_peer(addr: str, where: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``.

    Raises:
        ValueError: not ``host:port`` with a port in 1-65535 (the message names ``where``).
    """
    host, sep, port = addr.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{where}: {addr!r} is not host:port (port 1-65535)")
    return host, int(port)


class P2PTierConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``{"type": "p2p", ...}``.

    Attributes:
        host: where the control socket binds (``127.0.0.1`` unless told otherwise; ``0.0.0.0`` all
            interfaces, then ``advertise_host`` is required).
        port: the control port (+ the data-parallel rank); 0 picks a free one (tests).
        advertise_host: the address peers reach this instance at; default ``host``.
        peers: the static peer list, ``["host:port", ...]``, asked in this order.
        transport: how bulk bytes move: ``nixl``, ``tcp`` or ``auto`` (NIXL when importable).
        data_host, data_port: the TCP transport's data server (default: ``host``, any port).
        secret: the shared secret peers authenticate with (never logged); default: the
            environment variable named by ``secret_env``.
        secret_env: the environment variable holding the secret (``KVOFFLOAD_P2P_SECRET``).
        auth: ``secret`` (default) or ``none``, accepted only when ``host`` is a loopback address.
        heartbeat_s: heartbeat interval (seconds).
        peer_timeout_s: a peer silent this long is down: its jobs fail, it is reconnected with
            backoff (seconds, default 2).
        transfer_deadline_s: a bulk transfer not done by then fails (seconds, default 2).
        lease_ttl_s: how long a serving instance keeps a lease's slots pinned at most (seconds;
            at least 5x ``transfer_deadline_s``, so a transfer reported done always ran while
            its lease held).
        negative_ttl_s: how long "no peer has it" is trusted (seconds; 0: not kept).
        failed_load_ttl_s: how long a key whose load failed answers MISS (seconds).
        quota_chunks: chunks this instance admits from peers' pushes (0: none).
        push: ``off`` (default), ``when_full`` (offer chunks to peers while the host tier is
            full and evicting) or ``always`` (offer every stored chunk).
        hold_s: how long a prefiller holds a request's chunks for its remote decoder (seconds).
        lookup_cache_entries: bound on remembered "at peer X" verdicts.
        locality: as reported in KV events (``REMOTE``).
        peer_events: where peers publish their KV events, so that a lookup asks the peer that
            holds a chunk first: peer id (``host:port``) -> ``"tcp://host:port"``, or
            ``{"endpoint", "replay_endpoint", "topic"}``, or a list of them (one per
            data-parallel rank); see :mod:`kvoffload.tiers.p2p.locations`.
        max_located_chunks: chunk locations kept per peer publisher (LRU).
        replay_timeout_s: how long a replay of a peer's events may take (seconds).
    """

    # What a field left None means (``kvoffload check`` prints these words).
    unset_means: ClassVar[dict[str, str]] = {
        "advertise_host": "auto: host's value",
        "data_host": "auto: host's value",
        "secret": "auto: from the environment variable secret_env names",
    }

    host: str = "127.0.0.1"
    port: _Port = 5710
    advertise_host: str | None = None
    peers: list[str] = []
    transport: Literal["nixl", "tcp", "auto"] = "auto"
    data_host: str | None = None
    data_port: _Port = 0
    secret: str | None = None
    secret_env: str = SECRET_ENV
    auth: Literal["secret", "none"] = "secret"
    heartbeat_s: Seconds = 0.5
    peer_timeout_s: Seconds = 2.0
    transfer_deadline_s: Seconds = 2.0
    lease_ttl_s: Seconds = 30.0
    negative_ttl_s: TTLSeconds = 1.0
    failed_load_ttl_s: TTLSeconds = 10.0
    quota_chunks: Annotated[int, msgspec.Meta(ge=0)] = 0
    push: Literal["off", "when_full", "always"] = "off"
    hold_s: Seconds = 60.0
    lookup_cache_entries: Positive = 1_000_000
    locality: Literal["LOCAL", "REMOTE"] = "REMOTE"
    peer_events: dict[str, Any] = {}
    max_located_chunks: Positive = 262_144
    replay_timeout_s: Seconds = 5.0

    def __post_init__(self) -> None:
        problems = []
        for i, p in enumerate(self.peers):
            try:
                parse_peer(p, f"peers[{i}]")
            except ValueError as e:
                problems.append(str(e))
        try:
            event_sources(self.peer_events, "peer_events")
        except ValueError as e:
            problems.append(str(e))
        if self.lease_ttl_s < 5 * self.transfer_deadline_s:
            problems.append(
                f"lease_ttl_s ({self.lease_ttl_s}) must be at least 5x transfer_deadline_s "
                f"({self.transfer_deadline_s}): a lease must outlive every transfer of it"
            )
        if self.heartbeat_s >= self.peer_timeout_s:
            problems.append(
                f"heartbeat_s ({self.heartbeat_s}) must be below peer_timeout_s "
                f"({self.peer_timeout_s})"
            )
        if self.host in ("0.0.0.0", "::") and not self.advertise_host:
            problems.append(
                f"advertise_host: required when host is {self.host!r} (peers must be told an "
                "address they can reach)"
            )
        if self.auth == "none" and not _is_loopback(self.host):
            problems.append(
                f'auth: "none" is accepted only on a loopback host, not {self.host!r}; set '
                f"secret or the {self.secret_env} environment variable"
            )
        raise_problems(problems)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
