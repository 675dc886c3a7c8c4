"""A request's p2p routing, read from the ``kv_transfer_params`` an orchestrator gives it, and the
allow-list it must pass before any socket is made.

In vLLM 0.33's shape: whom the p2p tier asks first, or only, and for which decoder it holds a
prefill's chunks.

- ``remote_prefiller`` {``kv_request_id``, ``remote_host``, ``remote_port``}: a decoder; pull from
  that prefiller and no other peer.
- ``remote_kv_source`` {the same fields}: ask that peer first, then the others.
- ``remote_decoder`` {``kv_request_id``}: a prefiller; hold the request's chunks (their host slots
  pinned) until that decoder has read them. Its host and port, if given, are not used.

``kv_transfer_params`` come from whoever sends the API request, so an address they name is only a
choice among peers this instance already trusts (:class:`PeerPolicy`): the static ``peers``, the
``peer_events`` peers, the peers authenticated to this instance now (their advertise address; with
``auth: secret`` only, as a session under ``auth: none`` proves nothing) and ``allowed_peers``. Any other is refused: the request goes on without it (a ``remote_prefiller``
refused leaves that request no peer: a miss), never an error to the API user.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Collection, Iterable
from typing import Any

from kvoffload.tiers.p2p.config import AllowedPeer, ip_literal, parse_allowed, parse_peer

log = logging.getLogger("kvoffload.p2p")

ROUTE_REFUSALS = ("not_allowed", "malformed", "self")
"""Why a peer a request named is not asked (``kvoffload_p2p_refused_routes_total{reason}``): not an
allowed peer, not a ``host:port`` (or a sub-dict without its fields), this instance itself."""


class Route:
    """One request's routing from its ``kv_transfer_params``."""

    __slots__ = ("source", "only", "kv_request_id", "decoder_id", "malformed")

    def __init__(
        self,
        source: str | None,
        only: bool,
        kv_request_id: str,
        decoder_id: str,
        malformed: str = "",
    ):
        self.source = source  # a peer to ask first ("host:port")
        self.only = only  # remote_prefiller: that peer and no other
        self.kv_request_id = kv_request_id
        self.decoder_id = decoder_id  # remote_decoder: hold stores for this kv_request_id
        self.malformed = malformed  # the key of a sub-dict that named no usable peer, or ""


def parse_route(params: Any) -> Route | None:
    """The p2p routing of one request's ``kv_transfer_params`` (vLLM 0.33's shape), or None.

    A sub-dict that lacks its fields or names no ``host:port`` is ignored (its key is kept in
    :attr:`Route.malformed`, for the count): the request then takes the default path
    (configured peers), never a wrong peer.
    """
    if not isinstance(params, dict):
        return None
    decoder = params.get("remote_decoder")
    decoder_id = ""
    if isinstance(decoder, dict) and isinstance(decoder.get("kv_request_id"), str):
        decoder_id = decoder["kv_request_id"]
    source, only, kvr, malformed = None, False, "", ""
    for name, is_only in (("remote_prefiller", True), ("remote_kv_source", False)):
        role = params.get(name)
        if not isinstance(role, dict):
            continue
        host, port, rid = (
            role.get("remote_host"),
            role.get("remote_port"),
            role.get("kv_request_id"),
        )
        try:
            if host and port and isinstance(rid, str) and rid:
                source = f"{host}:{int(port)}"
                parse_peer(source, name)
                only, kvr = is_only, rid
                break
            malformed = malformed or name
        except (TypeError, ValueError):
            log.debug("p2p: ignoring a malformed %s in kv_transfer_params: %r", name, role)
            source = None
            malformed = malformed or name
    if source is None and not decoder_id and not malformed:
        return None
    return Route(source, only, kvr, decoder_id, malformed)


class PeerPolicy:
    """Which peers a request's routing may name (see the module docstring).

    Args:
        static: the configured peers (``peers`` and the ``peer_events`` peer ids), as written.
        allowed: the ``allowed_peers`` entries (:func:`~.config.parse_allowed`).
        own: this instance's own ``host:port`` names (never dialed for a request).
    """

    def __init__(self, static: Iterable[str], allowed: Iterable[str], own: Iterable[str] = ()):
        self.static = frozenset(static)
        self.own = frozenset(own)
        self.addrs: set[tuple[str, int]] = set()
        self.hosts: set[str] = set()
        self.networks: list[AllowedPeer] = []
        for i, entry in enumerate(allowed):
            a = parse_allowed(entry, f"allowed_peers[{i}]")
            if a.network is not None:
                self.networks.append(a)
            elif a.port is None:
                self.hosts.add(a.host)
            else:
                self.addrs.add((a.host, a.port))

    def refusal(self, addr: str, authenticated: Collection[str] = ()) -> str | None:
        """None if a request may name ``addr`` (``host:port``), else why not (one of
        :data:`ROUTE_REFUSALS`). ``authenticated``: the advertise addresses of the peers
        authenticated to this instance now (the tier passes none under ``auth: none``). Names are compared as written, never resolved."""
        if addr in self.own:
            return "self"
        if addr in self.static or addr in authenticated:
            return None
        try:
            host, port = parse_peer(addr, "route")
        except ValueError:
            return "malformed"
        ip = ip_literal(host)
        name = ip if ip is not None else host.lower()
        if (name, port) in self.addrs or name in self.hosts:
            return None
        if ip is not None:
            for a in self.networks:
                net = a.network
                assert net is not None
                if (a.port is None or a.port == port) and ip_in(ip, net):
                    return None
        return "not_allowed"


def ip_in(ip: str, network: Any) -> bool:
    """Whether the IP address ``ip`` (canonical text) lies in ``network``."""
    addr = ipaddress.ip_address(ip)
    return addr.version == network.version and addr in network
