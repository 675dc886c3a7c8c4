"""Chunks a tier would not take: counted by reason and explained in the log.

Every refusal adds its chunks to ``Stats.refused[(tier, direction, reason)]``
(``kvoffload_refused_chunks_total``; the reasons are :data:`~kvoffload.stats.HOST_REFUSALS`,
:data:`~kvoffload.stats.TIER_REFUSALS` and a secondary tier's own ``store_refusal``) and logs one
line saying why and what to change, at most once a minute per ``(tier, direction, reason)``. The
host tier's lines name the ``cpu_bytes_to_use`` that would have held the chunks.
"""

from __future__ import annotations

import logging

from kvoffload.host import HostTier
from kvoffload.ipc.ratelimit import RateLimitedLog
from kvoffload.stats import HOST, Stats

log = logging.getLogger("kvoffload")

_DROP_WHY = {
    "pin_limit": "its stores in flight already pin {pinned} host slots (tier_pin_fraction allows "
    "{limit})",
    "queue_full": "too many of its stores in flight (max_pending_store_chunks): the tier is slower "
    "than the offload rate",
    "breaker_open": "its circuit breaker is not closed (the tier keeps failing)",
    "prefix_hole": "an earlier chunk of the same request was not written there (dropped or "
    "failed), so no lookup could reach these past the hole",
}


class Refusals:
    """The refusals of one tiering manager.

    Args:
        host: the host tier (read for the log lines: slots pinned, being written).
        stats: the manager's counters (``refused`` is counted there).
        row_bytes: bytes per host slot.
        cpu_bytes_to_use: the configured host-tier size (bytes), for the advice.
        request_chunks: host chunks one request of the engine's longest length takes (0:
            unknown); the advice names at least that.
        pin_limit: host slots one tier's in-flight stores may pin (``tier_pin_fraction``).
    """

    def __init__(
        self,
        host: HostTier,
        stats: Stats,
        row_bytes: int,
        cpu_bytes_to_use: int,
        request_chunks: int,
        pin_limit: int,
    ):
        self.host = host
        self.stats = stats
        self.row_bytes = row_bytes
        self.cpu_bytes_to_use = cpu_bytes_to_use
        self.request_chunks = request_chunks
        self.pin_limit = pin_limit
        self._log = RateLimitedLog(log)

    def promotion(self, tier_name: str) -> None:
        """A chunk found in ``tier_name`` is not promoted: no evictable host slot."""
        self._refuse(
            HOST,
            "load",
            "no_evictable_slot",
            1,
            logging.WARNING,
            "kvoffload: a chunk found in tier %s is not promoted (a miss): no "
            "evictable host slot (%s); %s",
            tier_name,
            self._occupancy(),
            self._room_advice(1),
        )

    def store_truncated(self, room: int, new: int) -> None:
        """The host tier took ``room`` of a store's ``new`` chunks."""
        self._refuse(
            HOST,
            "store",
            "batch_truncated",
            new - room,
            logging.INFO,
            "kvoffload: host tier took %d of %d new chunk(s) of a store; the "
            "rest did not fit (%s); %s",
            room,
            new,
            self._occupancy(),
            self._room_advice(new - room),
        )

    def store_rejected(self, new: int) -> None:
        """The host tier took none of a store's ``new`` chunks: no evictable slot."""
        self._refuse(
            HOST,
            "store",
            "no_evictable_slot",
            new,
            logging.WARNING,
            "kvoffload: host tier refused a store of %d chunk(s): no evictable slot (%s); %s",
            new,
            self._occupancy(),
            self._room_advice(new),
        )

    def left_to_tier(self, skipped: int) -> None:
        """The host tier left ``skipped`` chunks of a store to the secondary tier known to hold
        them, so as not to evict chunks held for waiting requests."""
        self._refuse(
            HOST,
            "store",
            "in_tier",
            skipped,
            logging.INFO,
            "kvoffload: host tier left %d chunk(s) of a store to the secondary tier that holds "
            "them: its room goes to chunks promoted for waiting requests (%s)",
            skipped,
            self._occupancy(),
        )

    def tenant_quota(self, direction: str, refused: int, tenant: str) -> None:
        """The host tier refused ``refused`` chunks of a ``direction`` (``store``: a store or a
        peer's push; ``load``: a promotion) because their tenant (``tenant``, "" when not known
        here) was at its quota and none of its own chunks could be evicted (all pinned, being
        written or held)."""
        quotas = self.host.quotas
        limit = quotas.limit(tenant) if quotas is not None and tenant else None
        held = quotas.held.get(tenant, 0) if quotas is not None and tenant else 0
        self._refuse(
            HOST,
            direction,
            "tenant_quota",
            refused,
            logging.INFO,
            "kvoffload: host tier refused %d chunk(s) (%s) of tenant %s: it holds %d bytes of "
            "its quota of %s and none of its own chunks could be evicted (pinned, being "
            "written or held for a load); raise its quota (host_tenant_quotas) if it needs more",
            refused,
            direction,
            tenant or "(not known here)",
            held,
            limit if limit is not None else "?",
        )

    def tier_store(self, tier_name: str, reason: str, dropped: int, pinned: int) -> None:
        """``dropped`` chunks are not written to ``tier_name`` (``reason``: ``pin_limit`` with
        ``pinned`` host slots pinned by its stores, or the tier's own refusal)."""
        self._refuse(
            tier_name,
            "store",
            reason,
            dropped,
            logging.WARNING,
            "kvoffload: %d chunk(s) not written to tier %s: %s",
            dropped,
            tier_name,
            _DROP_WHY.get(reason, reason).format(pinned=pinned, limit=self.pin_limit),
        )

    def _occupancy(self) -> str:
        """Why host slots cannot be evicted, for a log line."""
        host = self.host
        writing = host.num_used - host.num_evictable - host.num_pinned
        return (
            f"of {host.num_slots} slots, {host.num_pinned} pinned by transfers in flight and "
            f"{writing} being written"
        )

    def _room_advice(self, short: int) -> str:
        """The fix for a host tier that had no room for ``short`` more chunks, for a log line:
        the ``cpu_bytes_to_use`` that would have held them beside every chunk in flight (no slot
        was evictable: each was being written or read), or one request of the engine's longest
        length (``request_chunks``) when that is more."""
        host, row = self.host, self.row_bytes
        need = host.num_slots + short
        what = f"room for the {host.num_slots} in flight and {short} more"
        if self.request_chunks > need:
            need, what = self.request_chunks, "one request of the engine's longest length"
        return (
            f"raise cpu_bytes_to_use (now {self.cpu_bytes_to_use} bytes, {host.num_slots} "
            f"chunks) to at least {need * row} bytes: {need} chunks of {row} bytes, {what}"
        )

    def _refuse(
        self, tier: str, direction: str, reason: str, chunks: int, level: int, msg: str, *args
    ) -> None:
        """Count ``chunks`` refused by ``tier`` and say why in the log, at most once a minute
        per ``(tier, direction, reason)``."""
        key = (tier, direction, reason)
        refused = self.stats.refused
        refused[key] = refused.get(key, 0) + chunks
        self._log.log(level, "/".join(key), msg, *args)
