"""What each failure and refusal reason means, and whether an operator should act on it.

Two metrics count chunks by a ``reason`` label, and ``kvoffload stress`` prints the same counts:

- ``kvoffload_tier_failed_chunks_total{tier, direction, reason}``: a chunk of a job that a tier
  accepted and could not complete (a load becomes a miss: the engine recomputes; a store leaves the
  chunk out of that tier). The reasons are the workers' result codes (``kvoffload.ipc.messages``
  ``CODE_NAMES``) and the engine's own (:data:`FAILED`).
- ``kvoffload_refused_chunks_total{tier, direction, reason}``: a chunk a tier would not take at all
  (:data:`REFUSED`; the host tier's and every secondary tier's, ``kvoffload.stats``
  ``HOST_REFUSALS`` and ``TIER_REFUSALS``).

Each entry is ``(what happened, what to do)``; the second is ``"none"`` where the reason is part of
normal operation. docs/observability.md carries the same table (a test keeps the two equal).
"""

from __future__ import annotations

from typing import NamedTuple


class Reason(NamedTuple):
    """One reason label value: ``meaning`` (what happened) and ``action`` (``"none"`` when it is
    normal operation, else what to look at or change)."""

    meaning: str
    action: str


NO_ACTION = "none"

#: ``reason`` values of ``kvoffload_tier_failed_chunks_total``.
FAILED: dict[str, Reason] = {
    "missing": Reason(
        "the chunk was not in the tier when the job ran (evicted, or removed by another instance "
        "or a cleaner, after the lookup): a miss",
        "none, unless it rises steadily on a shared root: then something else deletes chunks",
    ),
    "speculative_miss": Reason(
        "a chunk loaded without an existence probe, because an earlier chunk of the same "
        "request was found on the medium where the tier had no record of it (written by "
        "another instance, or before a restart), was not there: a miss like missing (it and the "
        "chunks after it are recomputed), never wrong bytes; counted among the tier's hits at "
        "its lookup",
        "none: a prefix that goes on past what was stored (a new turn) ends so; "
        "max_speculative_chunks bounds it per request, 0 probes every chunk first",
    ),
    "corrupt": Reason(
        "the stored copy failed its header or checksum check and was removed: a miss, never "
        "wrong bytes",
        "look at the storage if it keeps rising (truncated files, a co-tenant writing the root)",
    ),
    "io_error": Reason(
        "a transient I/O failure (EIO, a timeout, an S3 5xx after retries); the stored copy is "
        "left alone",
        "if it persists, the storage is unhealthy: the tier's log names the error; "
        "breaker_failures cuts the tier off while it lasts",
    ),
    "no_space": Reason(
        "the tier is full (ENOSPC, a quota, or its min_free_fraction floor); it evicts its own "
        "oldest chunks for the shortage the disk shows, nothing when statvfs shows room "
        "(counted as no_space_with_room)",
        "none if occasional; if steady, give the tier room (free disk, max_bytes, "
        "min_free_fraction); if no_space_with_room keeps rising, the storage reports ENOSPC "
        "with room: look at it",
    ),
    "timeout": Reason(
        "a task ran past job_timeout_s (or a peer transfer past transfer_deadline_s); its worker "
        "was replaced",
        "the storage or peer is slower than the deadline: look at it, or raise job_timeout_s",
    ),
    "worker_died": Reason(
        "the worker process holding the task died (killed, out of memory, a crash); other tasks "
        "it held ran again on its replacement",
        "none if rare; if recurring, the worker's stderr and the kernel log say why",
    ),
    "cancelled": Reason(
        "the tier shut down, or the job's chunks were reset, before it ran", NO_ACTION
    ),
    "rejected": Reason(
        "refused without an attempt: a store of a chunk whose delete (after its eviction) was "
        "still pending, written on a later offer; an object store's 4xx other than 404 "
        "(permissions, credentials); a p2p store with no decoder route",
        "none for fs stores; for an obj tier check its credentials and bucket policy if it rises",
    ),
    "error": Reason(
        "the worker's I/O code raised something unexpected (a bug, or an out-of-tree I/O "
        "module's error); counted in kvoffload_tier_events_total{event='task_errors'} with a "
        "traceback on the worker's stderr",
        "report it, with that traceback",
    ),
    "bad_reply": Reason(
        "a worker's or peer's reply did not answer the chunk (a protocol breach): the chunk "
        "failed rather than trust it",
        "report it (a peer running another kvoffload version also causes it)",
    ),
    "forged": Reason(
        "the tier has an integrity key (integrity_key_env) and the stored chunk's keyed MAC was "
        "missing or wrong: it was written without the key (instances with another key or none "
        "use another namespace); or the tier encrypts (encryption_key_env) and the chunk's "
        "AES-GCM tag did not verify under a good checksum (damage to any stored byte is "
        "corrupt): written without this master key, or moved from another tenant's, key's or "
        "namespace's place (counted in kvoffload_tier_events_total{event='decrypt_failures'}); "
        "removed, a miss, never its bytes",
        "something without the key writes the root or bucket prefix: find it (file owners, the "
        "bucket's access logs) and take its write access away",
    ),
    "unsafe_path": Reason(
        "fs: a symbolic link (removed, never followed) or a special file where the tier's own "
        "shard directory or chunk file belongs; nothing was read or written there: a failed "
        "store, or a miss",
        "someone else writes the root: check its owners and modes (the tier creates it 0700, or "
        "2770 with share_with_group) and who is in its group",
    ),
    "tenant_quota": Reason(
        "a capped fs or obj tier refused the chunk at admission: its tenant (a request's "
        "cache_salt) held its quota there (tenant_quota_bytes, tenant_quotas) and none of its "
        "own chunks could be evicted for it (each was loading or part of the same store); "
        "never written, as a no_space refusal",
        "none if occasional; if steady for one tenant, raise its quota in that tier "
        "(tenant_quotas) or look at why its chunks are all in use",
    ),
    "busy": Reason(
        "p2p load: the peer had leased as many chunks as it allows at once (half its host "
        "tier); asked again later",
        "none if occasional; if steady, raise the serving peer's cpu_bytes_to_use",
    ),
    "peer_down": Reason(
        "p2p load: the peer went silent or its session dropped mid-load; the next lookup asks "
        "another peer",
        "if recurring, check the network to that peer and peer_timeout_s",
    ),
    "transfer_failed": Reason(
        "p2p load: the bulk transfer (NIXL or TCP) failed; the session starts again",
        "if recurring, the p2p tier's log names the transport error",
    ),
    "deadline": Reason(
        "p2p load: the transfer did not settle by its deadline (transfer_deadline_s)",
        "a slow or congested link: look at it, or raise transfer_deadline_s",
    ),
    "lease_expired": Reason(
        "p2p load or pulled push: the transfer was not over before the lease the serving peer "
        "granted could end (its lifetime, reckoned from the request, less a margin): the slots may "
        "have been reused, so the bytes are not served; the session starts again",
        "none if rare; if steady, the serving peer is stalled or the link slow: look at it, or "
        "raise the serving peer's lease_ttl_s",
    ),
    "digest_mismatch": Reason(
        "p2p load or pulled push: a chunk's bytes did not match the digest the serving peer took "
        "when it granted the slot: a miss, never its bytes",
        "report it if it recurs: the serving peer changed a granted chunk (a bug), or someone "
        "wrote its arena (with NIXL any authenticated peer can) or the data path",
    ),
    "not_fetched": Reason(
        "p2p store held for a remote decoder: the decoder did not read it within hold_s; the "
        "chunks stay in the host tier",
        "none if the decoder was rerouted; else check the decoder's p2p tier and routing",
    ),
    "hold_displaced": Reason(
        "p2p store held for a remote decoder: no decoder had begun to read it when a newer "
        "request's hold needed its pins (the tier's in-flight stores may pin at most "
        "tier_pin_fraction of the host slots); the oldest unread holds go first and the chunks "
        "stay in the host tier",
        "none if rare; if steady, decoders read late or never (check their routing), or "
        "requests name decoders that never come (kv_transfer_params from API users): raise "
        "tier_pin_fraction or lower hold_s",
    ),
    "no_peer": Reason(
        "p2p push: no peer was up to offer the chunks to", "none; check peers if it persists"
    ),
}

#: ``reason`` values of ``kvoffload_refused_chunks_total`` (and of the dropped stores they count).
REFUSED: dict[str, Reason] = {
    "no_evictable_slot": Reason(
        "host tier: every slot was pinned (being copied to or from the device or to a tier) or "
        "being written, so a store or a promotion found no room",
        "raise cpu_bytes_to_use: the host tier should hold at least one request's chunks "
        "(max_model_len tokens; the engine's start-up warning gives the figure)",
    ),
    "batch_truncated": Reason(
        "host tier: the tail of a store batch that did not fit; its head was kept",
        "none if occasional; if steady, raise cpu_bytes_to_use",
    ),
    "in_tier": Reason(
        "host tier: chunks a secondary tier already holds were left there rather than evict "
        "chunks promoted for waiting requests (a recomputed tail offered again)",
        NO_ACTION,
    ),
    "tenant_quota": Reason(
        "host tier: a store's or a promotion's chunks whose tenant (a request's cache_salt) "
        "held its quota (host_tenant_quota_bytes, host_tenant_quotas) and none of whose own "
        "chunks could be evicted (pinned, being written, held for a load); a store keeps the "
        "longest prefix that fits",
        "none if occasional; if steady for one tenant, raise its quota (host_tenant_quotas)",
    ),
    "pin_limit": Reason(
        "a secondary tier's stores in flight already pin tier_pin_fraction of the host slots: "
        "the tier is slower than the offload rate, and the host tier keeps taking chunks",
        "none if bursts; if steady, give the tier more writers (write_workers, io_threads) or "
        "faster storage",
    ),
    "queue_full": Reason(
        "a secondary tier already has max_pending_store_chunks chunks in flight",
        "as for pin_limit: the tier cannot keep up with the offload rate",
    ),
    "breaker_open": Reason(
        "the tier's circuit breaker is open or half-open (its tasks kept failing): stores are "
        "dropped until a trial succeeds",
        "look at why the tier fails (kvoffload_tier_failed_chunks_total, the tier's log)",
    ),
    "prefix_hole": Reason(
        "a secondary tier: an earlier chunk of the same request was dropped (another reason) or "
        "failed there, and a prefix is usable only up to its first missing chunk, so its later "
        "chunks are not written to that tier (CASES C48)",
        "as for the first chunk's reason (pin_limit, queue_full, breaker_open, or the tier's "
        "failures in kvoffload_tier_failed_chunks_total)",
    ),
}


def explain(reason: str, refused: bool = False) -> Reason | None:
    """The catalogue entry of a failure (``refused=False``) or refusal reason, None when the
    reason is not in it."""
    return (REFUSED if refused else FAILED).get(reason)
