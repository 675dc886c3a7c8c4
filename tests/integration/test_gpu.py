"""On a CUDA GPU: the arena pinned, the copy path's bytes and throughput (the demo on a GPU vLLM is
tests/e2e/test_gpu.py).

Skipped (with the reason) where CUDA is absent; ``tools/gpu_check.sh`` sets a GPU machine up, runs
this file (and, without ``--quick``, tests/e2e/test_gpu.py) and judges the figures. Figures are recorded, never asserted (tests do not depend on
speed): each test adds its section to the JSON file named by ``KVOFFLOAD_GPU_REPORT`` and prints it.

- pinning: the arena's rows registered with the driver (``kvoffload.pinning``), through torch's and
  vLLM's CUDA runtime bindings; ``is_pinned()`` before, during and after.
- copy: the vLLM worker's own copy path (``KVOffloadWorker`` -> vLLM's stream-based handlers over the
  pinned arena) against a pinned ``cudaMemcpy`` of the same bytes (``Tensor.copy_`` between a
  pinned host tensor and a device tensor, non-blocking), both directions, in one process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import time

import pytest
import torch
from helpers import arena_name

from kvoffload.ipc.arena import Arena
from kvoffload.pinning import HostRegistration, pin_arena, register_pieces

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA,
    reason="no CUDA device: torch.cuda.is_available() is False (tools/gpu_check.sh runs "
    "this file on a GPU machine)",
)
gpu = [pytest.mark.gpu, needs_cuda]

PAGE = 32 * 1024  # bytes per block per tensor: 16 tokens x 8 KV heads x 128 dims x bf16
TENSORS = 64  # 32 layers x (K, V)


def _vllm_cuda() -> str | None:
    """Why vLLM's CUDA copy path cannot run here, or None when it can."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (tools/gpu_check.sh installs a CUDA build)"
    try:
        from vllm.platforms import current_platform
    except Exception as e:
        return f"vLLM does not import: {e!r}"
    if not current_platform.is_cuda():
        return f"vLLM's platform is {current_platform.device_name!r}, not CUDA (a CPU build?)"
    return None


def _record(section: str, figures: dict) -> None:
    """Print ``figures`` and merge them under ``section`` into ``$KVOFFLOAD_GPU_REPORT``."""
    print(f"\n[{section}] {json.dumps(figures)}")
    path = os.environ.get("KVOFFLOAD_GPU_REPORT")
    if not path:
        return
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError):
        report = {}
    report[section] = figures
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


def _skip(section: str, reason: str):
    _record(section, {"skipped": reason})
    pytest.skip(reason)


# -- pinning ----------------------------------------------------------------------------------------


def test_register_pieces_end_on_row_boundaries_within_the_bound():
    row = 3 * 4096
    pieces = register_pieces(1 << 20, 10 * row, row, max_bytes=4 * row + 100)
    assert pieces == [((1 << 20) + i * 4 * row, n * row) for i, n in enumerate((4, 4, 2))]
    assert register_pieces(0, 2 * row, row, max_bytes=1) == [(0, row), (row, row)]  # >= one row
    with pytest.raises(ValueError, match="multiple of the row size"):
        register_pieces(0, row + 1, row)


def test_where_the_platform_cannot_pin_the_arena_stays_pageable_and_nothing_is_held():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike() or current_platform.is_xpu():
        pytest.skip(f"vLLM's platform {current_platform.device_name!r} can pin host memory")
    with Arena.create(arena_name(), 4, 4096) as arena:
        reg = pin_arena(arena, backend="vllm")
        assert reg.backend == "vllm" and not reg.pinned and reg.pieces == []
        assert not arena.torch_rows().is_pinned()
        reg.release()
        with pytest.raises(ValueError, match="unknown pinning backend 'cuda'"):
            pin_arena(arena, backend="cuda")


@pytest.mark.parametrize("backend", [pytest.param(b, marks=gpu) for b in ("torch", "vllm")])
@pytest.mark.parametrize("max_piece_rows", [None, 3])
def test_arena_registers_as_pinned_memory_and_unregisters(backend, max_piece_rows):
    if backend == "vllm" and (why := _vllm_cuda()):
        _skip(f"pinning-{backend}", why)
    num_slots, row_bytes = 8, 4 * PAGE
    with Arena.create(arena_name(), num_slots, row_bytes) as arena:
        rows = arena.torch_rows()
        assert not rows.is_pinned()
        limit = {} if max_piece_rows is None else {"max_piece_bytes": max_piece_rows * row_bytes}
        reg = pin_arena(arena, backend=backend, **limit)
        try:
            assert reg.pinned and reg.backend == backend
            assert len(reg.pieces) == (1 if max_piece_rows is None else 3)
            assert rows.is_pinned() and rows[0].is_pinned() and rows[-1].is_pinned()
            # Non-blocking copies through the registered pages, both ways, byte-exact.
            src = torch.randint(-128, 128, rows.shape, dtype=torch.int8, device="cuda")
            rows.copy_(src, non_blocking=True)
            back = torch.empty_like(src)
            back.copy_(rows, non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(back, src)
            assert torch.equal(rows, src.cpu())
        finally:
            reg.release()
        assert not reg.pinned and not reg.pieces
        assert not rows.is_pinned() and not rows[-1].is_pinned()
        reg.release()  # idempotent
        # The range can be registered again once released (nothing was left registered).
        with HostRegistration(
            arena.base_address(), num_slots * row_bytes, row_bytes, backend=backend
        ) as again:
            assert again.pinned and rows.is_pinned()
        assert not rows.is_pinned()
        del rows
    _record(
        f"pinning-{backend}-{'one' if max_piece_rows is None else 'pieces'}",
        {"pinned": True, "unregistered": True, "pieces": 1 if max_piece_rows is None else 3},
    )


# -- the copy path ----------------------------------------------------------------------------------


def _worker_rig(arena, num_blocks: int, bpc: int):
    """KV tensors on the GPU (``TENSORS`` of ``(num_blocks, PAGE)`` int8, random) and a
    ``KVOffloadWorker`` over ``arena`` (rows of ``TENSORS * bpc`` pages)."""
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    from kvoffload.vllm.worker import KVOffloadWorker

    gen = torch.Generator(device="cuda").manual_seed(0)
    device = [
        torch.randint(-128, 128, (num_blocks, PAGE), dtype=torch.int8, device="cuda", generator=gen)
        for _ in range(TENSORS)
    ]
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, PAGE) for t in device],
        group_data_refs=[[CanonicalKVCacheRef(i, PAGE) for i in range(TENSORS)]],
    )
    worker = KVOffloadWorker(kv, arena, TENSORS * PAGE * bpc, 0, bpc)
    return device, worker


def _finish(worker, job_id: int) -> object:
    """Wait for ``job_id`` and return its TransferResult."""
    worker.wait({job_id})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for r in worker.get_finished():
            if r.job_id == job_id:
                return r
        time.sleep(0.001)
    raise AssertionError(f"transfer {job_id} not reported finished within 60 s of its event")


def _row_pages(arena, slots: list[int], bpc: int) -> torch.Tensor:
    """``(len(slots), TENSORS, bpc, PAGE)`` int8 copy of arena rows (direct layout)."""
    rows = arena.torch_rows()[slots, : TENSORS * bpc * PAGE]
    return rows.reshape(len(slots), TENSORS, bpc, PAGE).clone()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("bpc", [1, 2])
def test_device_copy_path_round_trip_is_byte_exact(bpc):
    if why := _vllm_cuda():
        _skip(f"copy-exact-bpc{bpc}", why)
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    with Arena.create(arena_name(), 8, TENSORS * PAGE * bpc) as arena:
        device, worker = _worker_rig(arena, 32, bpc)
        try:
            assert worker._cuda is not None and worker._cuda._pinning.pinned
            assert arena.torch_rows().is_pinned()
            original = [t.clone() for t in device]
            # Blocks 3..7 at logical block index 1 (unaligned to the chunk when bpc == 2).
            blocks = [3, 4, 5, 6, 7]
            n_chunks = -(-(len(blocks) + 1 % bpc) // bpc)
            slots = list(range(2, 2 + n_chunks))
            assert worker.submit_store(
                1, GPULoadStoreSpec(blocks, [5], [1]), CPULoadStoreSpec(slots)
            )
            r = _finish(worker, 1)
            assert r.success and r.transfer_size == len(blocks) * TENSORS * PAGE
            # (slot, tensor, sub-block, page) -> one (tensor, page) stack per logical block
            pages = _row_pages(arena, slots, bpc).permute(0, 2, 1, 3).reshape(-1, TENSORS, PAGE)
            skip = 1 % bpc
            for i, b in enumerate(blocks):
                expect = torch.stack([t[b] for t in original]).cpu()
                assert torch.equal(pages[skip + i], expect), f"block {b} in the arena differs"
            for t in device:
                t[blocks] = 0
            dest = [20, 21, 22, 23, 24]
            assert worker.submit_load(2, CPULoadStoreSpec(slots), GPULoadStoreSpec(dest, [5], [1]))
            assert _finish(worker, 2).success
            torch.cuda.synchronize()
            for t, o in zip(device, original):
                assert torch.equal(t[dest], o[blocks])
            assert int(_row_pages(arena, [0, 1], bpc).abs().sum()) == 0  # other slots untouched
        finally:
            worker.shutdown()
        assert not arena.torch_rows().is_pinned()  # the worker unregistered the arena
    _record(f"copy-exact-bpc{bpc}", {"byte_exact": True})


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up: streams, events, descriptor buffers, Triton compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@pytest.mark.gpu
@needs_cuda
def test_copy_path_throughput_against_pinned_memcpy_of_the_same_bytes():
    """Figures only: the ratio's target (>= 0.8) is judged by tools/gpu_check.sh."""
    if why := _vllm_cuda():
        _skip("copy", why)
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    row_bytes = TENSORS * PAGE
    wanted = int(os.environ.get("KVOFFLOAD_GPU_COPY_BLOCKS", "128"))
    fits = shutil.disk_usage("/dev/shm").free // (2 * row_bytes)  # leave half of /dev/shm free
    n = min(wanted, fits)
    if n < 8:
        _skip("copy", f"/dev/shm has room for {fits} rows of {row_bytes} bytes; 8 needed")
    nbytes = n * row_bytes
    repeats = 5
    with Arena.create(arena_name(), n, row_bytes) as arena:
        device, worker = _worker_rig(arena, 2 * n, 1)
        try:
            src_blocks, dst_blocks, slots = list(range(n)), list(range(n, 2 * n)), list(range(n))
            original = [t[:n].clone() for t in device]
            jobs = iter(range(1, 1 << 30))
            event_s = {"store": [], "load": []}

            def store():
                job = next(jobs)
                assert worker.submit_store(
                    job, GPULoadStoreSpec(src_blocks, [n], [0]), CPULoadStoreSpec(slots)
                )
                r = _finish(worker, job)
                assert r.success and r.transfer_size == nbytes
                event_s["store"].append(r.transfer_time)

            def load():
                job = next(jobs)
                assert worker.submit_load(
                    job, CPULoadStoreSpec(slots), GPULoadStoreSpec(dst_blocks, [n], [0])
                )
                r = _finish(worker, job)
                assert r.success and r.transfer_size == nbytes
                event_s["load"].append(r.transfer_time)

            ours_store = _median_s(store, repeats)
            ours_load = _median_s(load, repeats)
            torch.cuda.synchronize()
            for t, o in zip(device, original):
                assert torch.equal(t[n:], o), "a block came back different"
            pinned_arena = worker._cuda._pinning.pinned
        finally:
            worker.shutdown()
        del device, original
    # The baseline: one contiguous copy of the same bytes between pinned host memory and the GPU.
    host = torch.empty(nbytes, dtype=torch.int8, pin_memory=True)
    dev = torch.randint(-128, 128, (nbytes,), dtype=torch.int8, device="cuda")

    def memcpy_d2h():
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()

    def memcpy_h2d():
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    base_store = _median_s(memcpy_d2h, repeats)
    base_load = _median_s(memcpy_h2d, repeats)
    assert torch.equal(dev.cpu(), host)

    def gbps(seconds: float) -> float:
        return nbytes / seconds / 1e9

    _record(
        "copy",
        {
            "bytes": nbytes,
            "blocks": n,
            "tensors": TENSORS,
            "page_bytes": PAGE,
            "repeats": repeats,
            "arena_pinned": pinned_arena,
            "byte_exact": True,
            "store_gbps": gbps(ours_store),
            "load_gbps": gbps(ours_load),
            "store_event_gbps": nbytes / statistics.median(event_s["store"][1:]) / 1e9,
            "load_event_gbps": nbytes / statistics.median(event_s["load"][1:]) / 1e9,
            "memcpy_d2h_gbps": gbps(base_store),
            "memcpy_h2d_gbps": gbps(base_load),
            "store_ratio": base_store / ours_store,
            "load_ratio": base_load / ours_load,
            "device": torch.cuda.get_device_name(),
        },
    )
