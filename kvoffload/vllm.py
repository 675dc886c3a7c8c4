"""vLLM plug-in: ``spec_name: "KVOffloadSpec"``, ``spec_module_path: "kvoffload.vllm"``.

::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.vllm",
        "cpu_bytes_to_use": 4294967296,
        "secondary_tiers": [{"type": "fs", "root_dir": "/mnt/nvme/kvcache"}]}}'

vLLM's ``OffloadingConnector`` creates one :class:`KVOffloadSpec` in the scheduler process
(``get_manager``: the tiering manager, the host tier's slot table and the tier worker processes) and
one per model-runner rank (``get_worker``: KV copies between the accelerator and arena rows). Both
open the engine's arena by a name derived from vLLM's engine id; whichever comes first creates it.

The spec's name differs from vLLM's registered ``CPUOffloadingSpec`` / ``TieringOffloadingSpec``:
vLLM resolves those from its own registry and never reads ``spec_module_path`` for them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable
from typing import Any

from kvoffload import logs, metrics
from kvoffload.config import (
    ConfigError,
    OffloadConfig,
    describe,
    ineffective_vllm_keys,
    parse_config,
)
from kvoffload.events import ChunkEventInfo
from kvoffload.ipc.arena import Arena, default_name, round_up_to_page, sweep
from kvoffload.namespace import GroupShape, Namespace, model_fingerprint
from kvoffload.tiering import HOST, TieringManager
from kvoffload.tiers.base import LookupResult as KVLookup
from kvoffload.vllm_compat import (
    CanonicalKVCaches,
    CPULoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingConfig,
    OffloadingConnectorStats,
    OffloadingEvent,
    OffloadingKVEventsConfig,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    calling_request,
    convert_block_hash,
    current_model_config,
    drop_tolerated,
    event_block_hash,
    hit_source,
    nondeterministic_block_hashes,
)
from kvoffload.vllm_worker import KVOffloadWorker

log = logging.getLogger("kvoffload.vllm")
_STATS_INTERVAL_S = 0.5
_NOTED: set[str] = set()  # vLLM-only keys already logged in this process

_TO_VLLM = {
    KVLookup.HIT: LookupResult.HIT,
    KVLookup.MISS: LookupResult.MISS,
    KVLookup.HIT_PENDING: LookupResult.HIT_PENDING,
    KVLookup.RETRY: LookupResult.RETRY,
}
_MEDIUM = {"CPU": Medium.CPU, "STORAGE": Medium.STORAGE}
_LOCALITY = {"LOCAL": Locality.LOCAL, "REMOTE": Locality.REMOTE}


def engine_namespace(
    cfg: OffloadingConfig,
    *,
    layout: str,
    blocks_per_chunk: int,
    row_bytes: int,
    model_revision: str | None,
    cache_salt: str,
) -> Namespace:
    """The namespace of one vLLM engine's chunks (DESIGN.md §4, "Keys and namespaces").

    Args:
        cfg: vLLM's ``OffloadingConfig`` (model, dtype, KV groups, parallel geometry).
        layout: the row layout id (how bytes sit in a row), e.g. ``vllm-direct-v1:NHD``.
        blocks_per_chunk: engine blocks per chunk.
        row_bytes: bytes per chunk row.
        model_revision: used when vLLM does not report the model's revision.
        cache_salt: the ``cache_salt`` setting.
    """
    import os

    mc = current_model_config()
    revision = getattr(mc, "revision", None) or model_revision
    model = cfg.model.name
    path = os.path.realpath(model) if os.path.isdir(model) else None
    agnostic = bool(cfg.canonical_layout) and cfg.parallel.is_parallelism_agnostic
    # A canonical page holds every rank's heads: its size, not one worker's share, is the same
    # under every geometry (CASES C35).
    page_bytes = cfg.worker_kv_bytes_per_block * (
        canonical_copies(cfg) if cfg.canonical_layout else 1
    )
    groups = tuple(
        GroupShape(
            tokens_per_block=g.tokens_per_block,
            num_layers=len(g.layer_names),
            page_bytes=page_bytes,
            kind=f"group{g.group_id}",
        )
        for g in cfg.groups
    )
    par = cfg.parallel
    return Namespace(
        model=model,
        revision=revision,
        model_path=path,
        model_fingerprint=model_fingerprint(path) if path else None,
        kv_dtype=cfg.model.dtype,
        layout=layout,
        tokens_per_chunk=cfg.groups[0].tokens_per_block * blocks_per_chunk,
        row_bytes=row_bytes,
        groups=groups,
        tp_size=None if agnostic else par.tp_size,
        pp_size=None if agnostic else par.pp_size,
        pcp_size=None if agnostic else par.pcp_size,
        dcp_size=None if agnostic else par.dcp_size,
        cache_salt=cache_salt,
    )


def canonical_copies(cfg: OffloadingConfig) -> int:
    """How many workers' pages of a block make one canonical page (vLLM's
    ``CanonicalPageMapping.canonical_page_size_bytes`` / ``local_page_size_bytes``), known on the
    scheduler side, before any worker has reported its mapping.

    Attention KV is split by heads across TP ranks: ``min(tp_size, total KV heads)`` distinct head
    shards (ranks beyond the head count hold replicas); an MLA latent is replicated on every rank
    (one shard). Context parallelism splits a block's tokens over ``dcp_size * pcp_size`` ranks.
    Without a model config in this process (standalone use) the head count is unknown and every
    TP rank is taken to hold its own heads. The worker checks the figure against its mappings
    (:class:`kvoffload.vllm_worker.KVOffloadWorker`) and refuses to start on a mismatch.
    """
    par = cfg.parallel
    tp = max(par.tp_size, 1)
    mc = current_model_config()
    if cfg.replicated_layout or getattr(mc, "use_mla", False):
        shards = 1
    else:
        shards = tp
        try:
            total_heads = int(mc.get_total_num_kv_heads()) if mc is not None else 0
        except Exception:
            total_heads = 0
        if 0 < total_heads < tp:
            shards = total_heads
    return shards * max(par.dcp_size, 1) * max(par.pcp_size, 1)


class KVOffloadSpec(OffloadingSpec):
    """vLLM ``OffloadingSpec`` for kvoffload (see the module docstring for the config).

    Raises (at construction, before any process or segment exists):
        ConfigError: an invalid ``kv_connector_extra_config``, naming the key.
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """vLLM's metric hook (frontend process): every ``kvoffload_*`` metric, plus those the
        configured tiers declare, so they appear on vLLM's ``/metrics``.

        Raises:
            ConfigError: the config is invalid (the same error the engine would raise).
        """
        cfg = parse_config(dict(extra_config))
        defs = list(metrics.CORE_METRICS)
        for spec in cfg.secondary_tiers:
            defs.extend(spec.tier_class.metric_definitions)
        return metrics.vllm_metric_definitions(metrics.MetricSet(defs).defs.values())

    def __init__(self, config: OffloadingConfig, *args: Any, **kwargs: Any):
        drop_tolerated(kwargs)
        logs.setup()
        super().__init__(config)
        self.settings: OffloadConfig = parse_config(dict(config.extra_config))
        for note in ineffective_vllm_keys(dict(config.extra_config)):
            if note not in _NOTED:
                _NOTED.add(note)
                log.warning(
                    "kvoffload: kv_connector_extra_config.%s (a setting of vLLM's own "
                    "tiering spec, accepted and not used here)",
                    note,
                )
        s = self.settings
        if OffloadingKVEventsConfig is not None and hasattr(self, "kv_events_config"):
            # vLLM's own publisher: its tracker gives our CPU / STORAGE events the request's
            # parent hash and token ids (kvoffload's default on; vLLM's spec default is off)
            self.kv_events_config = OffloadingKVEventsConfig(
                enable_kv_cache_events=self.kv_events_config.enable_kv_cache_events,
                self_describing_kv_events=s.self_describing_kv_events,
            )
        par = config.parallel
        self.replicated = bool(config.replicated_layout) and not config.canonical_layout
        if config.canonical_layout:
            # One canonical area holding every rank's heads: the same row under any TP size.
            num_copies = canonical_copies(config)
        else:
            num_copies = 1 if self.replicated else max(par.world_size, 1)
        self.canonical_copies = num_copies if config.canonical_layout else None
        self.worker_page_bytes = config.worker_kv_bytes_per_block * self.blocks_per_chunk
        self.row_bytes = (
            round_up_to_page(self.worker_page_bytes * num_copies) if (self.worker_page_bytes) else 0
        )
        self.num_slots = s.cpu_bytes_to_use // self.row_bytes if self.row_bytes else 0
        if self.row_bytes and self.num_slots == 0:
            raise ConfigError(
                f"kv_connector_extra_config.cpu_bytes_to_use: {s.cpu_bytes_to_use} bytes cannot hold "
                f"one chunk of {self.row_bytes} bytes; raise it or lower blocks_per_chunk"
            )
        self.arena_name = s.arena_name or default_name(config.engine_id)
        self._arena: Arena | None = None
        self._manager: KVOffloadManager | None = None
        self._worker: KVOffloadWorker | None = None

    # -- identity -------------------------------------------------------------------------------

    def namespace(self) -> Namespace:
        """The namespace of this engine's chunks (model, revision, dtype, layout, geometry...)."""
        layout = "vllm-canonical-v1" if self.config.canonical_layout else "vllm-direct-v1"
        if self.config.kv_cache_layout:
            layout += f":{self.config.kv_cache_layout}"
        if self.replicated:
            layout += ":replicated"
        return engine_namespace(
            self.config,
            layout=layout,
            blocks_per_chunk=self.blocks_per_chunk,
            row_bytes=self.row_bytes,
            model_revision=self.settings.model_revision,
            cache_salt=self.settings.cache_salt,
        )

    def _open_arena(self) -> Arena:
        if self._arena is None:
            if self.num_slots == 0:
                raise ConfigError("kvoffload: the engine reported no KV cache to offload")
            self._arena = Arena.open_or_create(
                self.arena_name, self.num_slots, self.row_bytes, self.config.engine_id
            )
        return self._arena

    # -- vLLM interface -------------------------------------------------------------------------

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            reason = nondeterministic_block_hashes()
            if reason and self.settings.secondary_tiers:
                raise ConfigError(
                    f"kvoffload: vLLM block hashes are not reproducible across processes ({reason}); "
                    f"shared tiers would never hit. Set PYTHONHASHSEED or use the sha256 hash"
                )
            removed = sweep()
            if removed:
                log.info(
                    "kvoffload: removed %d arena(s) of dead engines: %s", len(removed), removed
                )
            owned = self._arena is None
            arena = self._open_arena()
            log.info("kvoffload: %s", describe(self.settings))
            ns = self.namespace()
            try:
                tm = TieringManager(
                    arena,
                    ns,
                    self.settings,
                    record_events=self.kv_events_config.enable_kv_cache_events,
                    keep_metric_samples=True,
                    event_block_hash=event_block_hash,
                    data_parallel_rank=getattr(self.config.parallel, "data_parallel_index", 0),
                )
            except BaseException:
                if owned:  # a rank that cannot start leaves no segment (CASES C30)
                    arena.close()
                    self._arena = None
                raise
            log.info(
                "kvoffload: arena %s (%d slots x %d bytes), namespace %s, tiers %s",
                arena.name,
                arena.num_slots,
                arena.row_bytes,
                ns.id(),
                tm.tier_names,
            )
            host_tokens = arena.num_slots * ns.tokens_per_chunk
            max_len = getattr(current_model_config(), "max_model_len", None)
            if max_len and host_tokens < max_len:
                log.warning(
                    "kvoffload: the host tier holds %d tokens, less than max_model_len %d: "
                    "every offloaded chunk passes through it, so longer requests are only "
                    "partly offloaded (their first %d tokens); raise cpu_bytes_to_use",
                    host_tokens,
                    max_len,
                    host_tokens,
                )
            self._manager = KVOffloadManager(tm, self._event_geometry())
        return self._manager

    def _event_geometry(self) -> dict[int, tuple[int, int]]:
        """KV-cache group -> (tokens per block, tokens per chunk), for groups whose vLLM block
        hashes are per block (the request's hashes index directly)."""
        per_hash = getattr(self.config.cache, "tokens_per_hash", None)
        return {
            g.group_id: (g.tokens_per_block, g.tokens_per_block * self.blocks_per_chunk)
            for g in self.config.groups
            if g.tokens_per_block == per_hash
        }

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            logs.setup()
            arena = self._open_arena()
            rank = 0 if self.replicated else self.config.parallel.rank
            canonical = bool(self.config.canonical_layout)
            self._worker = KVOffloadWorker(
                kv_caches,
                arena,
                self.row_bytes,
                rank * self.worker_page_bytes,
                self.blocks_per_chunk,
                canonical=canonical,
                rank=rank,
                canonical_copies=self.canonical_copies,
                parallelism_agnostic=canonical and self.config.parallel.is_parallelism_agnostic,
            )
        return self._worker


class _RequestChunks:
    """One request's chunks as :class:`~kvoffload.events.ChunkEventInfo`, computed per key when
    asked (:meth:`~kvoffload.tiering.TieringManager.prepare_store`'s ``chunk_info``): the
    request's block hashes and token ids over the key's token range (its end from the
    ``ReqContext``), the values of vLLM's own ``BlockStored`` for those blocks. Kept in the
    context's state; :meth:`release` (request finished) drops both references, so neither the
    request nor the context waits for the cyclic garbage collector."""

    __slots__ = ("ctx", "geometry", "req")

    def __init__(self, req: Any, ctx: ReqContext, geometry: dict[int, tuple[int, int]]):
        self.req = req
        self.ctx = ctx
        self.geometry = geometry

    def release(self) -> None:
        self.req = self.ctx = None

    def get(self, key: bytes) -> ChunkEventInfo | None:
        if self.req is None:
            return None
        end = self.ctx.get_offload_key_position(key)
        group = int.from_bytes(key[-4:], "big")
        shape = self.geometry.get(group)
        if end is None or shape is None:
            return None
        block, chunk = shape
        start = end - chunk
        hashes = self.req.block_hashes
        first, last = start // block, end // block
        # the key names the chunk's last block: anything else (a window group's layout, a
        # request whose hashes moved on) gets the plain event, never a wrong parent
        if start < 0 or last > len(hashes) or hashes[last - 1] != key[:-4]:
            return None
        return ChunkEventInfo(
            block_hashes=[convert_block_hash(h) for h in hashes[first:last]],
            parent_block_hash=convert_block_hash(hashes[first - 1]) if first else None,
            token_ids=list(self.req.all_token_ids[start:end]),
            block_size=block,
            group_idx=group,
        )


class KVOffloadManager(OffloadingManager):
    """vLLM ``OffloadingManager`` delegating to a :class:`~kvoffload.tiering.TieringManager`.

    Args:
        tiering: the tiering manager.
        event_geometry: KV-cache group -> (tokens per block, tokens per chunk); with kvoffload's
            own KV events on, a chunk of such a group is published with its request's parent
            hash and token ids.
    """

    def __init__(
        self, tiering: TieringManager, event_geometry: dict[int, tuple[int, int]] | None = None
    ):
        self.tm = tiering
        self._stats_at = 0.0
        self._medium = {HOST: "CPU", **{t.name: t.medium for t in tiering.tiers}}
        self._locality = {
            HOST: Locality.LOCAL,
            **{t.name: _LOCALITY.get(t.locality, Locality.LOCAL) for t in tiering.tiers},
        }
        self._geometry = event_geometry if tiering.publishes_events else None

    def lookup(self, key, req_context: ReqContext, **kwargs) -> LookupResult:
        return _TO_VLLM[self.tm.lookup(key, req_context.req_id)]

    def get_load_source(self, key, req_context: ReqContext):
        name = self.tm.source_of(key, req_context.req_id)
        return hit_source(HOST if name == HOST else self._medium[name])

    def prepare_load(self, keys: Collection, req_context: ReqContext, **kwargs):
        drop_tolerated(kwargs)
        return CPULoadStoreSpec(self.tm.prepare_load(list(keys), req_context.req_id))

    def touch(self, keys: Collection, req_context: ReqContext, **kwargs):
        self.tm.touch(list(keys), req_context.req_id)

    def complete_load(self, keys: Collection, req_context: ReqContext, **kwargs):
        self.tm.complete_load(keys, req_context.req_id)

    def prepare_store(self, keys: Collection, req_context: ReqContext, **kwargs):
        info = req_context.get_state(_RequestChunks) if self._geometry else None
        plan = self.tm.prepare_store(list(keys), req_context.req_id, info)
        if plan is None:
            return None
        return PrepareStoreOutput(
            keys_to_store=plan.keys,
            store_spec=CPULoadStoreSpec(plan.slots),
            evicted_keys=plan.evicted,
        )

    def complete_store(
        self, keys: Collection, req_context: ReqContext, success: bool = True, **kwargs
    ):
        self.tm.complete_store(keys, success, req_context.req_id)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        if self._geometry:
            req = calling_request(req_context.req_id)
            if req is not None:
                req_context.set_state(_RequestChunks(req, req_context, self._geometry))
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        if self._geometry:
            chunks = req_context.get_state(_RequestChunks)
            if chunks is not None:
                chunks.release()
        self.tm.on_request_finished(req_context.req_id)

    def on_schedule_end(self, context) -> None:
        self.tm.step()

    def has_pending_work(self) -> bool:
        return self.tm.has_pending_work()

    def take_events(self) -> Iterable[OffloadingEvent]:
        for tier_name, ev in self.tm.take_events():
            medium = _MEDIUM.get(self._medium[tier_name])
            if medium is None:
                continue
            host = tier_name == HOST
            # removal_expected: vLLM's tracker keeps a host chunk's payload until its removal
            # (bounded by the host slots); a tier's payload is not kept past the host's
            yield OffloadingEvent(
                keys=list(ev.keys),
                medium=medium,
                removed=ev.removed,
                locality=self._locality[tier_name],
                ownership=None if host else tier_name,
                removal_expected=host and not ev.removed,
            )

    def get_stats(self):
        """Metric changes since the last call (vLLM's ``OffloadingConnectorStats``), at most every
        ``_STATS_INTERVAL_S`` (vLLM asks every step; counters accumulate in between)."""
        now = time.monotonic()
        if now - self._stats_at < _STATS_INTERVAL_S:
            return None
        self._stats_at = now
        data = self.tm.take_metric_stats()
        return None if data is None else OffloadingConnectorStats(data=data)

    def reset_cache(self) -> None:
        self.tm.reset_cache()

    def shutdown(self) -> None:
        self.tm.shutdown()
        self.tm.arena.close()
