"""The counters of one tiering manager (:class:`Stats`) and the refusal reasons it counts.

Plain integers and dicts, bumped on the engine's hot path under the manager's lock and read by
:func:`kvoffload.metrics.refresh`, ``kvoffload stress`` and the tests (:meth:`Stats.snapshot`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvoffload.tiers.base import DEDUP_REASONS

HOST = "host"
"""The host tier's name wherever tiers are named (stats, metrics labels, events)."""

#: Why a tier refuses chunks, by (tier kind, direction): the ``reason`` label values of
#: ``kvoffload_refused_chunks_total`` (a secondary tier may add its own, see ``store_refusal``).
HOST_REFUSALS = (
    ("store", "no_evictable_slot"),
    ("store", "batch_truncated"),
    ("store", "in_tier"),
    ("store", "tenant_quota"),
    ("load", "no_evictable_slot"),
    ("load", "tenant_quota"),
)
TIER_REFUSALS = (
    ("store", "pin_limit"),
    ("store", "queue_full"),
    ("store", "breaker_open"),
    ("store", "prefix_hole"),
)

#: Why tokens a tier holds were recomputed instead (``kvoffload_recomputed_tokens``, config
#: ``slower_than_recompute``): the tier's load was expected to be slower than the recompute at
#: lookup, or its promotion overran its expected time and its chunks were answered MISS, or its
#: lookup (a probe) kept the request waiting past its deadline and the chunk was answered MISS;
#: or the online canary found wrong KV served by the tier and closed its loads (``canary``, with
#: the canary's ``fail_closed``; the host tier's series too: :mod:`kvoffload.canary`).
RECOMPUTE_REASONS = ("slower_than_recompute", "promotion_overran", "lookup_overran", "canary")


class Stats:
    """Counters of one tiering manager (chunks unless named otherwise). ``per_tier`` maps a tier
    name to its own counters.

    Refusals: ``store_rejections`` / ``store_truncations`` count host-tier store batches refused
    whole / cut short, ``promotion_alloc_failures`` promotions with no host slot, ``dropped_stores``
    chunks not written to a tier; ``refused`` counts the chunks of all of them by
    ``(tier, direction, reason)`` (reasons: :data:`HOST_REFUSALS`, :data:`TIER_REFUSALS`).
    """

    def __init__(self, tier_names: Sequence[str]):
        # Lookups are counted at their verdict (HIT, HIT_PENDING, MISS), never at a RETRY, and once
        # per request and chunk (the first verdict: vLLM looks a deferred request's chunks up again
        # every step, and a promoted chunk would then count as a tier hit and as host hits); every
        # verdict passes the host tier, so host_queries is the number of chunks looked up.
        self.host_queries = 0
        self.host_hits = 0
        self.tier_queries = {n: 0 for n in tier_names}
        self.tier_hits = {n: 0 for n in tier_names}
        self.promotions = {n: 0 for n in tier_names}
        self.promotion_failures = {n: 0 for n in tier_names}
        self.promotion_alloc_failures = 0
        # cascaded: chunks a tier took (its store succeeded), of which ``written`` it wrote and
        # ``deduplicated`` (tier, reason) it already held (CASES C50); ``transfer_bytes``
        # (tier, direction): bytes the tier reported moved (JobResult.transfer_bytes)
        self.cascaded = {n: 0 for n in tier_names}
        self.written = {n: 0 for n in tier_names}
        self.deduplicated: dict[tuple[str, str], int] = {
            (n, r): 0 for n in tier_names for r in DEDUP_REASONS
        }
        self.transfer_bytes: dict[tuple[str, str], int] = {
            (n, d): 0 for n in tier_names for d in ("load", "store")
        }
        self.cascade_failures = {n: 0 for n in tier_names}
        self.dropped_stores = {n: 0 for n in tier_names}
        self.store_rejections = 0
        self.store_truncations = 0
        self.unheld_completions = 0  # complete_load of a chunk the caller held no pin on (C28)
        self.stale_store_completions = 0  # complete_store of a write the caller does not hold
        self.unknown_job_results = 0  # results for a job id not in flight (duplicates, strays)
        self.reset_discarded_promotions = 0  # promotions a reset made moot while in flight
        # Promotion holds (config promotion_hold_steps): host misses told RETRY because the host
        # tier was full of chunks held for requests that asked earlier; held chunks evicted
        # before their request loaded them (by a store with no other room, or by the promotion
        # of a request that asked earlier); holds that lapsed (not looked up for
        # promotion_hold_steps steps).
        self.promotion_waits = 0
        self.evicted_holds = 0
        self.expired_holds = 0
        # Sliding-window chunks answered MISS after max_retry_steps steps of RETRY unchosen
        # (kvoffload.hybrid.WindowScans): a recompute instead of a request that never runs.
        self.window_retry_giveups = 0
        # (tier, reason) -> tokens of chunks a tier held that were answered MISS (recomputed)
        # because the tier was slower than recompute (RECOMPUTE_REASONS), once per request and chunk
        self.recomputed: dict[tuple[str, str], int] = {
            (n, r): 0 for n in tier_names for r in RECOMPUTE_REASONS
        }
        self.recomputed[(HOST, "canary")] = 0
        # The p2p serving side, counted apart from this instance's own lookups and loads:
        # keys peers looked up, found READY / PENDING, promotions started for them, chunks
        # leased, slots admitted for their pushes, pushes published / failed, and completions
        # (release, commit) naming nothing their holder holds.
        self.peer_lookups = 0
        self.peer_hits = 0
        self.peer_pending = 0
        self.peer_promotions = 0
        self.peer_leased = 0
        self.peer_admitted = 0
        self.peer_committed = 0
        self.peer_commit_failures = 0
        self.stale_peer_completions = 0
        self.loads_from = {HOST: 0, **{n: 0 for n in tier_names}}
        self.failed: dict[tuple[str, str, str], int] = {}  # (tier, direction, reason) -> chunks
        self.failed_jobs: dict[tuple[str, str], int] = {}  # (tier, direction) -> jobs
        # (tier, direction, reason) -> chunks; the known reasons start at 0 so that a scrape sees
        # every series from the start (Prometheus' increase() misses a series' first value)
        self.refused: dict[tuple[str, str, str], int] = {
            **{(HOST, d, r): 0 for d, r in HOST_REFUSALS},
            **{(n, d, r): 0 for n in tier_names for d, r in TIER_REFUSALS},
        }

    def snapshot(self) -> dict[str, Any]:
        """A copy of every counter (dict-valued ones copied too), for tools and tests to diff."""
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(self).items()}
