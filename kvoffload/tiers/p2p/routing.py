"""A request's p2p routing, read from the ``kv_transfer_params`` an orchestrator gives it.

In vLLM 0.33's shape: whom the p2p tier asks first, or only, and for which decoder it holds a
prefill's chunks.

- ``remote_prefiller`` {``kv_request_id``, ``remote_host``, ``remote_port``}: a decoder; pull from
  that prefiller and no other peer.
- ``remote_kv_source`` {the same fields}: ask that peer first, then the others.
- ``remote_decoder`` {``kv_request_id``}: a prefiller; hold the request's chunks (their host slots
  pinned) until that decoder has read them.
"""

from __future__ import annotations

import logging
from typing import Any

from kvoffload.tiers.p2p.config import parse_peer

log = logging.getLogger("kvoffload.p2p")


class Route:
    """One request's routing from its ``kv_transfer_params``."""

    __slots__ = ("source", "only", "kv_request_id", "decoder_id")

    def __init__(self, source: str | None, only: bool, kv_request_id: str, decoder_id: str):
        self.source = source  # a peer to ask first ("host:port")
        self.only = only  # remote_prefiller: that peer and no other
        self.kv_request_id = kv_request_id
        self.decoder_id = decoder_id  # remote_decoder: hold stores for this kv_request_id


def parse_route(params: Any) -> Route | None:
    """The p2p routing of one request's ``kv_transfer_params`` (vLLM 0.33's shape), or None.

    A sub-dict that lacks its fields is ignored (logged at debug): the request then takes the
    default path (configured peers), never a wrong peer.
    """
    if not isinstance(params, dict):
        return None
    decoder = params.get("remote_decoder")
    decoder_id = ""
    if isinstance(decoder, dict) and isinstance(decoder.get("kv_request_id"), str):
        decoder_id = decoder["kv_request_id"]
    source, only, kvr = None, False, ""
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
        except (TypeError, ValueError):
            log.debug("p2p: ignoring a malformed %s in kv_transfer_params: %r", name, role)
            source = None
    if source is None and not decoder_id:
        return None
    return Route(source, only, kvr, decoder_id)
