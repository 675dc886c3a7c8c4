"""The p2p tier's settings (``{"type": "p2p", ...}``) and their checks.

:class:`P2PTierConfig`, :func:`parse_peer` (a peer's ``host:port``), :func:`parse_allowed` (an
``allowed_peers`` entry) and :data:`SECRET_ENV`.
"""

from __future__ import annotations

import ipaddress
import os
import re
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

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


_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252})$")
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class AllowedPeer(NamedTuple):
    """One ``allowed_peers`` entry: a ``network`` (with any port, or ``port``), or a ``host`` (a
    name, lower-cased, or an IP address as written canonically) with any port or ``port``."""

    host: str
    network: IPNetwork | None
    port: int | None


def parse_allowed(entry: str, where: str) -> AllowedPeer:
    """An ``allowed_peers`` entry: ``host:port``, ``host`` (any port), or a network in CIDR form
    with an optional port (``10.0.0.0/8``, ``10.0.0.0/8:5710``, ``[fd00::/8]:5710``); a host is
    a name or an IP address (IPv6 in brackets when a port follows).

    Raises:
        ValueError: none of those (the message names ``where``).
    """
    bad = ValueError(
        f"{where}: {entry!r} is not host:port, host, or a network (10.0.0.0/8, with an "
        "optional :port)"
    )
    port: int | None = None
    if "/" in entry:
        net, _, rest = entry.partition("/")
        plen, _, port_s = rest.replace("]", "").partition(":")
        if port_s:
            if not port_s.isdigit() or not 0 < int(port_s) < 65536:
                raise bad
            port = int(port_s)
        try:
            network = ipaddress.ip_network(f"{net.strip('[')}/{plen}", strict=False)
        except ValueError:
            raise bad from None
        return AllowedPeer("", network, port)
    ip = ip_literal(entry.strip("[]"))
    if ip is not None and ":" in entry and not entry.startswith("["):  # a bare IPv6 address
        return AllowedPeer(ip, None, None)
    host, sep, port_s = entry.rpartition(":")
    if not sep:
        host, port_s = entry, ""
    elif not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise bad
    else:
        port = int(port_s)
    host = host.strip("[]") if host.startswith("[") and host.endswith("]") else host
    ip = ip_literal(host)
    if ip is not None:
        return AllowedPeer(ip, None, port)
    if not _HOSTNAME.match(host):
        raise bad
    return AllowedPeer(host.lower(), None, port)


def ip_literal(host: str) -> str | None:
    """``host`` as a canonical IP address string if it is one (an IPv4-mapped IPv6 address as
    its IPv4 address), else None. Names are never resolved."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


class P2PTierConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``{"type": "p2p", ...}``.

    Attributes:
        host: where the control socket binds (``127.0.0.1`` unless told otherwise; ``0.0.0.0`` all
            interfaces, then ``advertise_host`` is required).
        port: the control port (+ the data-parallel rank); 0 picks a free one (tests).
        advertise_host: the address peers reach this instance at; default ``host``.
        peers: the static peer list, ``["host:port", ...]``, asked in this order.
        allowed_peers: the peers a request's ``kv_transfer_params`` may name besides the
            static ``peers``, the ``peer_events`` peers and the peers authenticated to this
            instance (with ``auth: secret``): ``host:port``, ``host`` (any port) or a network (``10.0.0.0/8``, with an
            optional ``:port``); names are compared as written, never resolved. Any other
            address a request names is refused before a socket is made (counted).
        request_peer_idle_s: a link to a peer a request named is closed and forgotten when no
            request has used it for this long (seconds).
        max_request_peers: links to peers requests named, at most, at once (the least
            recently used idle one closed first, else the least recently used).
        transport: how bulk bytes move: ``nixl``, ``tcp`` or ``auto`` (NIXL when importable).
        data_host, data_port: the TCP transport's data server (default: ``host``, any port).
        secret: the shared secret peers authenticate with (never logged); default: the
            environment variable named by ``secret_env``.
        secret_env: the environment variable holding the secret (``KVOFFLOAD_P2P_SECRET``).
        auth: ``secret`` (default: CurveZMQ on every control socket, keyed from the secret, and
            whole-transcript MACs) or ``none``, accepted only when ``host`` is a loopback
            address and ``trust_local_users`` is true.
        trust_local_users: with ``auth: none``, says that every local user of this machine may
            read and write this instance's KV (any of them can connect to a loopback port).
        max_handshakes, max_handshakes_per_source: connections and handshakes not yet
            authenticated, at most, in all and per source address.
        heartbeat_s: heartbeat interval (seconds).
        peer_timeout_s: a peer silent this long is down: its jobs fail, it is reconnected with
            backoff (seconds, default 2).
        transfer_deadline_s: a bulk transfer not done by then fails (seconds, default 2).
        worker_nice: CPU niceness added to the peer worker process (0-19; default 0). Its
            transfers are loads a request waits for, while vLLM's engine loop steps without
            pause (it does so whenever a request waits for KV), and vLLM's own p2p tier moves its
            bytes in the scheduler's process at nice 0: at nice 10 (the fs workers' default) the
            whole tier moved 1.10-1.57 GB/s on 2 vCPUs against 1.57-2.15 at 0, every size and
            transport, alternated in one session (BENCHMARKS §10e). Raise it on a host with no
            core to spare where the scheduler's step time matters more than a load's.
        engine_switch_interval_s: the interpreter's thread switch interval in the engine's
            process while the tier runs (seconds, 0.0001-0.1, :func:`sys.setswitchinterval`;
            only ever lowered, given back at shutdown; null leaves it). The node thread needs
            the GIL for each hop of a load, and while vLLM's scheduler runs pure-Python steps it
            gets it only after this interval: during 2 ms steps on 2 vCPUs, 256 KiB loads moved
            0.16-0.39 GB/s (all submitted at once) and 0.19-0.25 (one a step) at CPython's
            5 ms, 0.58-2.04 and 0.32-0.41 at 0.5 ms (BENCHMARKS §9b).
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
        "engine_switch_interval_s": "the interpreter's, left as it is (sys.getswitchinterval)",
    }

    host: str = "127.0.0.1"
    port: _Port = 5710
    advertise_host: str | None = None
    peers: list[str] = []
    allowed_peers: list[str] = []
    request_peer_idle_s: Seconds = 60.0
    max_request_peers: Positive = 16
    transport: Literal["nixl", "tcp", "auto"] = "auto"
    data_host: str | None = None
    data_port: _Port = 0
    secret: str | None = None
    secret_env: str = SECRET_ENV
    auth: Literal["secret", "none"] = "secret"
    trust_local_users: bool = False
    max_handshakes: Positive = 64
    max_handshakes_per_source: Positive = 8
    heartbeat_s: Seconds = 0.5
    peer_timeout_s: Seconds = 2.0
    transfer_deadline_s: Seconds = 2.0
    worker_nice: Annotated[int, msgspec.Meta(ge=0, le=19)] = 0
    engine_switch_interval_s: Annotated[float, msgspec.Meta(ge=0.0001, le=0.1)] | None = 0.0005
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

    def shared_secret(self) -> str | None:
        """The secret the tier authenticates with, as it reads it at start: ``""`` under
        ``auth: none``, else ``secret`` or the environment variable ``secret_env`` names (in this
        process's environment); None where neither holds one (the tier refuses to start)."""
        if self.auth == "none":
            return ""
        secret = self.secret if self.secret is not None else os.environ.get(self.secret_env)
        return secret or None

    def __post_init__(self) -> None:
        problems = []
        for i, p in enumerate(self.peers):
            try:
                parse_peer(p, f"peers[{i}]")
            except ValueError as e:
                problems.append(str(e))
        for i, p in enumerate(self.allowed_peers):
            try:
                parse_allowed(p, f"allowed_peers[{i}]")
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
        # the way out: a secret, or (one given already) dropping auth none
        use_secret = (
            'remove auth (its default, "secret", uses the secret given)'
            if self.secret
            else f'remove auth (default "secret") and set the {self.secret_env} environment '
            "variable (or secret)"
        )
        if self.auth == "none" and not is_loopback(self.host):
            problems.append(
                f'auth: "none" is accepted only on a loopback host, not {self.host!r}; {use_secret}'
            )
        elif self.auth == "none" and not self.trust_local_users:
            problems.append(
                'auth: "none" needs trust_local_users: true: without a secret any local user '
                "of this machine can connect to the loopback port and read (and push) every "
                f"user's KV; set trust_local_users if that is so, else {use_secret}"
            )
        raise_problems(problems)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback IP address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
