"""The vLLM plug-in's spec: ``spec_name: "KVOffloadSpec"``, ``spec_module_path: "kvoffload.vllm"``.

vLLM's ``OffloadingConnector`` creates one :class:`KVOffloadSpec` in the scheduler process
(``get_manager``: the tiering manager, the host tier's slot table and the tier worker processes;
:class:`~kvoffload.vllm.manager.KVOffloadManager`) and one per model-runner rank (``get_worker``: KV
copies between the accelerator and arena rows; :class:`~kvoffload.vllm.worker.KVOffloadWorker`).
Both open the engine's arena by a name derived from vLLM's engine id; whichever comes first creates
it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from typing_extensions import override

from kvoffload import logs, metrics
from kvoffload.config import (
    ConfigError,
    OffloadConfig,
    describe,
    ineffective_vllm_keys,
    parse_config,
)
from kvoffload.hybrid import (
    GroupLayout,
    WindowScans,
    chunks_per_request,
    describe_groups,
    row_geometry,
)
from kvoffload.ipc.arena import Arena, default_name, round_up_to_page, sweep
from kvoffload.namespace import GroupShape, Namespace, model_fingerprint
from kvoffload.tiering import TieringManager
from kvoffload.vllm.compat import (
    CanonicalKVCaches,
    OffloadingConfig,
    OffloadingKVEventsConfig,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    calling_kv_cache_config,
    drop_tolerated,
    engine_vllm_config,
    event_block_hash,
    max_model_len,
    nondeterministic_block_hashes,
    vllm_metric_definitions,
)
from kvoffload.vllm.hybrid import group_layouts
from kvoffload.vllm.manager import KVOffloadManager
from kvoffload.vllm.worker import KVOffloadWorker

log = logging.getLogger("kvoffload.vllm")
_NOTED: set[str] = set()  # vLLM-only keys already logged in this process
_Method = TypeVar("_Method", bound=Callable[..., Any])


def _stops_the_start(method: _Method) -> _Method:
    """Wrap a step of the engine's start (the spec's construction, ``get_manager``,
    ``get_worker``): an exception it raises stops vLLM's start, and is said once more, at the
    end, by :func:`not_started`."""

    @functools.wraps(method)
    def step(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except Exception as e:
            not_started(e)
            raise

    return cast(_Method, step)


def not_started(error: BaseException) -> None:
    """kvoffload stopped an engine's start with ``error``: log ``kvoffload: not started:
    <reason>`` at ERROR as this process's last kvoffload line, when it exits
    (:func:`kvoffload.logs.log_at_exit`). vLLM prints the error inside a traceback in every
    process it crosses, then ends the log with its own "Engine core initialization failed";
    this line says, after all of that, why kvoffload stopped it. Only in a process vLLM started
    for an engine (a ``multiprocessing`` child holding a vLLM config: the engine core, a model
    runner), which ends with the failed start: in a main process (vLLM in-process, a program or
    test that makes a spec) the exception reaches the program, which may go on. The reason is
    the error's message on one line (other than a :class:`ConfigError`'s, prefixed with its
    type)."""
    import multiprocessing

    if multiprocessing.parent_process() is None or engine_vllm_config() is None:
        return
    reason = " ".join(str(error).split()).removeprefix("kvoffload: ")
    if not isinstance(error, ConfigError):
        reason = f"{type(error).__name__}: {reason}"
    logs.log_at_exit(logging.ERROR, f"kvoffload: not started: {reason}")


def engine_namespace(
    cfg: OffloadingConfig,
    *,
    layout: str,
    blocks_per_chunk: int,
    row_bytes: int,
    model_revision: str | None,
    cache_salt: str,
    layouts: Sequence[GroupLayout] | None = None,
    model_config: Any = None,
) -> Namespace:
    """The namespace of one vLLM engine's chunks (DESIGN.md §4, "Keys and namespaces").

    Args:
        cfg: vLLM's ``OffloadingConfig`` (model, dtype, KV groups, parallel geometry).
        layout: the row layout id (how bytes sit in a row), e.g. ``vllm-direct-v1:NHD``.
        blocks_per_chunk: engine blocks per chunk.
        row_bytes: bytes per chunk row.
        model_revision: used when vLLM does not report the model's revision.
        cache_salt: the ``cache_salt`` setting.
        layouts: the groups' kinds and shapes (:func:`kvoffload.vllm.hybrid.group_layouts`,
            one per ``cfg.groups`` entry); None: each group ``unknown``, as big as a worker block.
        model_config: the engine's vLLM ``ModelConfig`` (the ``model_config`` of
            :func:`kvoffload.vllm.compat.engine_vllm_config`): its ``revision`` (``--revision``)
            and KV-head count (canonical pages); None outside an engine.
    """
    import os

    revision = getattr(model_config, "revision", None) or model_revision
    model = cfg.model.name
    path = os.path.realpath(model) if os.path.isdir(model) else None
    agnostic = bool(cfg.canonical_layout) and cfg.parallel.is_parallelism_agnostic
    # A canonical page holds every rank's heads: its size, not one worker's share, is the same
    # under every geometry (CASES C35).
    page_copies = canonical_copies(cfg, model_config) if cfg.canonical_layout else 1
    if layouts is None:
        layouts = group_layouts(cfg, None, blocks_per_chunk)
    groups = tuple(
        GroupShape(
            tokens_per_block=g.tokens_per_block,
            num_layers=len(g.layer_names),
            page_bytes=layout.block_bytes * page_copies,
            kind=layout.kind,
            group_id=layout.group_id,
            window_chunks=layout.window_chunks,
            shape=layout.shape,
        )
        for g, layout in zip(cfg.groups, layouts, strict=True)
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


def canonical_copies(cfg: OffloadingConfig, model_config: Any = None) -> int:
    """How many workers' pages of a block make one canonical page (vLLM's
    ``CanonicalPageMapping.canonical_page_size_bytes`` / ``local_page_size_bytes``), known on the
    scheduler side, before any worker has reported its mapping.

    Attention KV is split by heads across TP ranks: ``min(tp_size, total KV heads)`` distinct head
    shards (ranks beyond the head count hold replicas); an MLA latent is replicated on every rank
    (one shard). Context parallelism splits a block's tokens over ``dcp_size * pcp_size`` ranks.
    ``model_config`` is the engine's vLLM ``ModelConfig`` (the scheduler and every model-runner
    rank must pass the same one: the figure sizes the rows of the arena they share); without one
    (standalone use) the head count is unknown and every TP rank is taken to hold its own heads.
    The worker checks the figure against its mappings
    (:class:`kvoffload.vllm.worker.KVOffloadWorker`) and refuses to start on a mismatch.
    """
    par = cfg.parallel
    tp = max(par.tp_size, 1)
    mc = model_config
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
    """vLLM ``OffloadingSpec`` for kvoffload (see :mod:`kvoffload.vllm` for the config).

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
        return vllm_metric_definitions(metrics.MetricSet(defs).defs.values())

    @_stops_the_start
    def __init__(self, config: OffloadingConfig, *args: Any, **kwargs: Any):
        drop_tolerated(kwargs)
        logs.setup()
        super().__init__(config)
        #: The engine's ``VllmConfig`` (None outside an engine): its model config, which vLLM's
        #: current-config global does not give the scheduler process (compat.engine_vllm_config).
        self.vllm_config = engine_vllm_config()
        self.model_config = getattr(self.vllm_config, "model_config", None)
        #: The longest request the engine accepts, in tokens (0: unknown).
        self.max_model_len = max_model_len(config, self.vllm_config)
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
        events = getattr(self, "kv_events_config", None)  # set by vLLM's OffloadingSpec
        if OffloadingKVEventsConfig is not None and events is not None:
            # vLLM's own publisher: its tracker gives our CPU / STORAGE events the request's
            # parent hash and token ids (kvoffload's default on; vLLM's spec default is off)
            self.kv_events_config = OffloadingKVEventsConfig(
                enable_kv_cache_events=events.enable_kv_cache_events,
                self_describing_kv_events=s.self_describing_kv_events,
            )
        par = config.parallel
        self.replicated = bool(config.replicated_layout) and not config.canonical_layout
        if config.canonical_layout:
            # One canonical area holding every rank's heads: the same row under any TP size.
            num_copies = canonical_copies(config, self.model_config)
        else:
            num_copies = 1 if self.replicated else max(par.world_size, 1)
        self.canonical_copies = num_copies if config.canonical_layout else None
        self.worker_page_bytes = config.worker_kv_bytes_per_block * self.blocks_per_chunk
        self.row_bytes = (
            round_up_to_page(self.worker_page_bytes * num_copies) if (self.worker_page_bytes) else 0
        )
        self.num_slots = s.cpu_bytes_to_use // self.row_bytes if self.row_bytes else 0
        try:
            self.group_layouts = group_layouts(
                config, calling_kv_cache_config(), self.blocks_per_chunk
            )
            self.group_rows = (
                row_geometry(self.group_layouts, self.row_bytes, self.blocks_per_chunk, num_copies)
                if self.row_bytes
                else ()
            )
        except ValueError as e:
            raise ConfigError(f"kvoffload: {e}; this KV-cache layout cannot be offloaded") from None
        #: Host-tier rows one request of ``max_model_len`` tokens takes (every group's chunks, a
        #: windowed group at most its window); 0 when ``max_model_len`` is not known.
        self.request_rows = (
            chunks_per_request(self.group_layouts, self.max_model_len) if self.max_model_len else 0
        )
        if self.row_bytes and self.num_slots == 0:
            raise ConfigError(self._too_small_for_one_chunk(num_copies))
        if s.warm_restart_s and not s.arena_name:
            raise ConfigError(
                "kv_connector_extra_config.warm_restart_s needs a fixed arena_name (one per "
                "instance, e.g. its port: the restarted engine finds its arena by that name)"
            )
        self.arena_name = s.arena_name or default_name(config.engine_id)
        self._arena: Arena | None = None
        self._manager: KVOffloadManager | None = None
        self._worker: KVOffloadWorker | None = None

    def _too_small_for_one_chunk(self, num_copies: int) -> str:
        """The error for a ``cpu_bytes_to_use`` below one chunk: the minimum (one chunk's
        bytes), a useful size (one request's rows, when ``max_model_len`` is known) and, for
        chunks of several blocks, the smaller chunk one block would make."""
        s, row = self.settings, self.row_bytes
        tokens = self.config.groups[0].tokens_per_block * self.blocks_per_chunk
        msg = (
            f"kv_connector_extra_config.cpu_bytes_to_use: {s.cpu_bytes_to_use} bytes cannot hold "
            f"one chunk ({tokens} tokens of every KV layer: {row} bytes); set it to at least {row}"
        )
        if self.request_rows:
            msg += (
                f", and to be useful to {self.request_rows * row} or more: one request of "
                f"max_model_len {self.max_model_len} tokens is {self.request_rows} chunks"
            )
        if self.blocks_per_chunk > 1:  # only then is there a smaller chunk to name
            one_block = round_up_to_page(self.config.worker_kv_bytes_per_block * num_copies)
            tokens_per_block = self.config.groups[0].tokens_per_block
            if "block_size" in self.config.extra_config:  # vLLM's key: tokens per chunk
                lever = f"block_size (now {tokens}) at {tokens_per_block}"
            else:
                lever = f"blocks_per_chunk (now {self.blocks_per_chunk}) at 1"
            msg += f"; or make chunks smaller: {lever} makes a chunk of {one_block} bytes"
        return msg

    def _host_capacity_warning(self, num_slots: int) -> None:
        """Warn when the host tier holds fewer tokens than one request of ``max_model_len``:
        every offloaded chunk passes through it, so a longer request is offloaded (and reloaded)
        only up to what it holds. Names both figures and the ``cpu_bytes_to_use`` that holds one
        request."""
        max_len, rows = self.max_model_len, self.request_rows
        host_tokens = num_slots * max_len // rows if rows else 0
        if not rows or host_tokens >= max_len:
            return
        log.warning(
            "kvoffload: the host tier holds %d tokens (cpu_bytes_to_use %d: %d chunks of %d "
            "bytes), fewer than max_model_len %d: every offloaded chunk passes through it, so a "
            "longer request is offloaded and reloaded only up to its first %d tokens; set "
            "cpu_bytes_to_use to at least %d (%d chunks) to hold one request",
            host_tokens,
            self.settings.cpu_bytes_to_use,
            num_slots,
            self.row_bytes,
            max_len,
            host_tokens,
            rows * self.row_bytes,
            rows,
        )

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
            layouts=self.group_layouts,
            model_config=self.model_config,
        )

    def _open_arena(self) -> Arena:
        if self._arena is None:
            if self.num_slots == 0:
                raise ConfigError("kvoffload: the engine reported no KV cache to offload")
            warm = self.settings.warm_restart_s
            self._arena = Arena.open_or_create(
                self.arena_name,
                self.num_slots,
                self.row_bytes,
                self.config.engine_id,
                table=warm > 0,
                keep_s=warm,
            )
        return self._arena

    # -- vLLM interface -------------------------------------------------------------------------

    @override
    @_stops_the_start
    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            reason = nondeterministic_block_hashes(self.vllm_config)
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
                    request_chunks=self.request_rows,
                )
            except BaseException:
                if owned:  # a rank that cannot start leaves no segment (CASES C30)
                    arena.close(keep=False)  # nor one for a keeper to hold (a warm restart)
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
            for line in describe_groups(self.group_layouts, self.group_rows):
                log.info("kvoffload: %s", line)
            self._host_capacity_warning(arena.num_slots)
            self._manager = KVOffloadManager(
                tm, self._event_geometry(), WindowScans(self.group_layouts)
            )
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

    @override
    @_stops_the_start
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
