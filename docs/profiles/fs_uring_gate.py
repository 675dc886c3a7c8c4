"""io_uring feasibility check for the fs tier's worker I/O (issue 13, targets 1 and 2).

Stores and loads N chunks of ``--chunk-kib`` KiB between a POSIX shared-memory buffer and chunk
files laid out as ``kvoffload.workers.fs_io`` lays them out (``<ns>/<hh>/<hh>/<key hex>.kv``: a
4096-byte header page and the payload written by one O_DIRECT write to an ``O_CREAT | O_EXCL``
temporary name in the chunk's own directory, then renamed over the final name; new shard
directories made on the way; the free-space floor checked per chunk), two ways, in one process:

- ``threads``: ``FsIO.store`` / ``FsIO.load`` called from a pool of ``--threads`` I/O threads, as
  the tier worker's I/O threads call them;
- ``uring``: per chunk, ``mkdir`` of the shard directories not yet known to exist (hard-linked:
  EEXIST does not break the chain), then a linked ``openat`` (into a direct descriptor) ->
  ``writev`` (header page + payload) -> ``close`` -> ``renameat`` chain on one io_uring (the
  ``liburing`` binding), ``--depth`` chunks in flight, submitted together; every chunk's
  existence check, free-space check and header (with its xxh3 checksum) done in Python exactly as
  the threads path does. Loads: ``openat`` -> ``readv`` (header page, payload into the row, one
  page past the end; hard-linked so the close runs after the expected short read) -> ``close``,
  the size, header and payload checksum verified in Python;
- ``threads-aged`` (only with ``--engines``): the threads path into a tree whose 65,536 shard
  directories were all made before the repetition, as in an aged tier.

Each engine loads the files the other wrote and compares every row with the source, so the check
also shows the two write the same format. The engines take turns every ``--round`` chunks (the
order flipping each turn), so both see the same background load; reported per engine and phase:
GB/s (payload bytes / wall seconds) and CPU seconds per GB (user + system of this process,
io_uring's kernel workers included: they are threads of it), medians of ``--reps``.

Run (from a checkout, with ``liburing`` importable)::

    PYTHONPATH=. python docs/profiles/fs_uring_gate.py --dir ./uring-gate --chunks 2048 --chunk-kib 256 --reps 3
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory

import liburing as L

from kvoffload.ipc import messages as m
from kvoffload.workers import chunkfile as cf
from kvoffload.workers.faults import Faults
from kvoffload.workers.fs_io import FsIO
from kvoffload.workers.ioconfig import FsIOConfig

NS = "00112233445566778899aabbccddeeff"
ENGINES = ("threads", "uring", "threads-aged")


def _cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


class UringFs:
    """The io_uring variant of FsIO's store and load for a batch of chunks."""

    def __init__(self, io: FsIO, depth: int):
        self.io = io
        self.depth = depth
        self.ring = L.Ring()
        L.io_uring_queue_init(8 * depth, self.ring)
        L.io_uring_register_files_sparse(self.ring, depth)
        self.cqe = L.Cqe()
        hdr = __import__("mmap").mmap(-1, 2 * cf.HEADER_BYTES * depth)
        self._pages = memoryview(hdr)
        self._dirs: set[str] = set()
        self._n = 0

    def close(self) -> None:
        """Tear the ring down (its direct descriptors with it)."""
        L.io_uring_queue_exit(self.ring)

    def _sqe(self, op_data: int, flags: int):
        sqe = L.io_uring_get_sqe(self.ring)
        L.io_uring_sqe_set_data64(sqe, op_data)
        if flags:
            L.io_uring_sqe_set_flags(sqe, flags)
        return sqe

    def store_all(self, keys: list[bytes], rows: list[memoryview]) -> list[int]:
        """Store ``rows[i]`` under ``keys[i]``; per chunk 2 (stored), 1 (already there) or a
        negative errno (-28: below the free-space floor)."""
        io = self.io
        free = list(range(self.depth))
        pending: dict[int, list] = {}  # slot -> [index, cqes left, results, keep-alive]
        status = [0] * len(keys)
        i = 0
        while i < len(keys) or pending:
            while i < len(keys) and free:
                key, row = keys[i], rows[i]
                final = io.path(key)
                if os.path.exists(final):
                    status[i] = 1
                    i += 1
                    continue
                if io.cfg.min_free_bytes and io._below_floor():
                    status[i] = -28
                    i += 1
                    continue
                slot = free.pop()
                hpage = self._pages[slot * 2 * cf.HEADER_BYTES : (slot * 2 + 1) * cf.HEADER_BYTES]
                hpage[:] = cf.build_header(io.ns_bytes, key, row)
                d = os.path.dirname(final)
                self._n += 1
                tmp = os.path.join(d, f".{key.hex()}.{io._tmp_tag}.{self._n}{cf.TMP_SUFFIX}")
                iov = L.Iovec([hpage, row])
                base = slot << 3
                n_ops = 4
                parent = os.path.dirname(d)  # kept alive until submitted: the SQE points at it
                if d not in self._dirs:  # EEXIST must not break the chain: hard links
                    if parent not in self._dirs:
                        L.io_uring_prep_mkdir(
                            self._sqe(base | 5, L.IOSQE_IO_HARDLINK), parent, 0o755
                        )
                        n_ops += 1
                    L.io_uring_prep_mkdir(self._sqe(base | 4, L.IOSQE_IO_HARDLINK), d, 0o755)
                    n_ops += 1
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT
                L.io_uring_prep_open_direct(
                    self._sqe(base, L.IOSQE_IO_LINK), tmp, flags, slot, 0o644
                )
                L.io_uring_prep_writev(
                    self._sqe(base | 1, L.IOSQE_IO_LINK | L.IOSQE_FIXED_FILE), slot, iov, 0
                )
                L.io_uring_prep_close_direct(self._sqe(base | 2, L.IOSQE_IO_LINK), slot)
                L.io_uring_prep_rename(self._sqe(base | 3, 0), tmp, final)
                pending[slot] = [i, n_ops, {}, (tmp, final, iov, d, parent)]
                i += 1
            L.io_uring_submit_and_wait(self.ring, 1)
            for p in self._finished(pending, free):
                r = p[2]
                if r[3] == 0:
                    status[p[0]] = 2
                    self._dirs.update(p[3][3:])  # known to exist: later chunks skip the mkdir
                else:  # a failed link: report the first real error, remove the temp file
                    err = next(v for k, v in sorted(r.items()) if k < 4 and v < 0)
                    status[p[0]] = err
                    try:
                        os.unlink(p[3][0])
                    except FileNotFoundError:
                        pass
        return status

    def load_all(self, keys: list[bytes], rows: list[memoryview]) -> list[int]:
        """Load ``keys[i]`` into ``rows[i]``; per chunk 2 (verified), a negative errno, or -1000
        (size), -1001 (header), -1002 (checksum)."""
        io = self.io
        free = list(range(self.depth))
        pending: dict[int, list] = {}
        status = [0] * len(keys)
        i = 0
        while i < len(keys) or pending:
            while i < len(keys) and free:
                key, row = keys[i], rows[i]
                slot = free.pop()
                off = slot * 2 * cf.HEADER_BYTES
                head = self._pages[off : off + cf.HEADER_BYTES]
                tail = self._pages[off + cf.HEADER_BYTES : off + 2 * cf.HEADER_BYTES]
                path = io.path(key)
                iov = L.Iovec([head, row, tail])
                base = slot << 3
                L.io_uring_prep_open_direct(
                    self._sqe(base, L.IOSQE_IO_LINK), path, os.O_RDONLY | os.O_DIRECT, slot
                )
                L.io_uring_prep_readv(
                    self._sqe(base | 1, L.IOSQE_IO_HARDLINK | L.IOSQE_FIXED_FILE), slot, iov, 0
                )
                L.io_uring_prep_close_direct(self._sqe(base | 2, 0), slot)
                pending[slot] = [i, 3, {}, (path, iov, head, row, key)]
                i += 1
            L.io_uring_submit_and_wait(self.ring, 1)
            for p in self._finished(pending, free):
                status[p[0]] = self._verify(p[2], p[3])
        return status

    def _verify(self, r: dict, keep: tuple) -> int:
        io = self.io
        _, _, head, row, key = keep
        if r[0] < 0:
            return r[0]
        if r[1] != io.file_bytes:
            return -1000
        try:
            checksum = cf.parse_header(head.tobytes(), io.ns_bytes, key, io.cfg.row_bytes)
        except cf.ChunkFormatError:
            return -1001
        if cf.record_checksum(head.tobytes(), row) != checksum:
            return -1002
        return 2

    def _finished(self, pending: dict[int, list], free: list[int]) -> list[list]:
        """The chains whose every operation has completed (each ``[index, ops left, {op: result},
        kept]``), taken out of ``pending`` with their slots back in ``free``."""
        done = []
        for user_data, res in self._reap():
            slot = user_data >> 3
            p = pending[slot]
            p[2][user_data & 7] = res
            p[1] -= 1
            if p[1] == 0:
                del pending[slot]
                free.append(slot)
                done.append(p)
        return done

    def _reap(self) -> list[tuple[int, int]]:
        out = []
        cqe = self.cqe
        for _ in L.CqeIter(self.ring, cqe):
            c = cqe[0]
            try:
                res = c.res
            except OSError as e:  # the binding raises for a negative result
                res = -(e.errno or 1)
            out.append((c.user_data, res))
        if out:
            L.io_uring_cq_advance(self.ring, len(out))
        return out


def _fs(root: str, row_bytes: int, floor: int) -> FsIO:
    return FsIO(
        FsIOConfig(root_dir=root, namespace_id=NS, row_bytes=row_bytes, min_free_bytes=floor),
        Faults([]),
    )


def _threads(io: FsIO, pool: ThreadPoolExecutor, what: str, keys, rows) -> list[int]:
    call = io.store if what == "store" else io.load
    outs = list(pool.map(call, keys, rows))
    return [2 if o.code == m.OK else -1 for o in outs]


def main() -> None:
    """Command line: see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="./uring-gate")
    ap.add_argument("--chunks", type=int, default=2048)
    ap.add_argument("--chunk-kib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--depth", type=int, default=8, help="uring: chunks in flight")
    ap.add_argument("--round", type=int, default=256, help="chunks per turn (engines alternate)")
    ap.add_argument(
        "--engines",
        default="threads,uring",
        help="comma list of " + ", ".join(ENGINES) + " (threads-aged: the threads path on a "
        "root whose 65,536 shard directories all exist, as in an aged tier)",
    )
    a = ap.parse_args()
    a.engines = tuple(a.engines.split(","))
    if len(a.engines) < 2 or not set(a.engines) <= set(ENGINES):
        ap.error(f"--engines: two or more of {', '.join(ENGINES)}")
    row = a.chunk_kib * 1024
    n = a.chunks
    st = os.statvfs(os.path.dirname(os.path.abspath(a.dir)) or ".")
    floor = int(0.05 * st.f_blocks * st.f_frsize)
    src = shared_memory.SharedMemory(create=True, size=n * row)
    dst = shared_memory.SharedMemory(create=True, size=n * row)
    try:
        _run(a, row, floor, src.buf, dst.buf)
    finally:
        for s in (src, dst):
            try:
                s.close()
            except BufferError:
                # liburing's Iovec keeps exports of the rows it was given (never released): the
                # mapping stays until exit; unlinking the segment is what matters
                s._mmap = None  # type: ignore[attr-defined]  # no second close at exit
            s.unlink()


def _run(a: argparse.Namespace, row: int, floor: int, sv: memoryview, dv: memoryview) -> None:
    n = a.chunks
    for j in range(n):  # distinct, incompressible-ish rows
        sv[j * row : (j + 1) * row] = os.urandom(64) * (row // 64)
    dv[:] = bytes(n * row)  # fault the destination in once, for both engines
    srows = [sv[j * row : (j + 1) * row] for j in range(n)]
    drows = [dv[j * row : (j + 1) * row] for j in range(n)]
    res: dict[tuple[str, str], list[tuple[float, float]]] = {}
    gb = n * row / 1e9
    rnd = max(1, min(a.round, n))
    engines = a.engines
    # loads read what the next engine in the list stored
    source = {e: engines[(i + 1) % len(engines)] for i, e in enumerate(engines)}
    for rep in range(a.reps):
        roots = {}
        for eng in engines:
            root = os.path.join(a.dir, f"{eng}-{rep}")
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(os.path.join(root, NS))
            if eng == "threads-aged":
                for d in range(65536):
                    os.makedirs(os.path.join(root, NS, f"{d >> 8:02x}", f"{d & 255:02x}"))
            roots[eng] = (root, [os.urandom(16) + j.to_bytes(4, "little") for j in range(n)])
        for phase in ("store", "load"):
            ios = {
                e: _fs(roots[e if phase == "store" else source[e]][0], row, floor) for e in engines
            }
            ring = UringFs(ios["uring"], a.depth) if "uring" in ios else None
            pool = ThreadPoolExecutor(a.threads)
            acc = {e: [0.0, 0.0, 0.0] for e in engines}
            rows = srows if phase == "store" else drows
            for r0 in range(0, n, rnd):  # engines take turns every `rnd` chunks, order rotating
                turn = (r0 // rnd + rep) % len(engines)
                order = engines[turn:] + engines[:turn]
                for eng in order:
                    keys = roots[eng if phase == "store" else source[eng]][1][r0 : r0 + rnd]
                    part = rows[r0 : r0 + rnd]
                    c0, t0 = _cpu(), time.perf_counter()
                    if ring is None or eng != "uring":
                        status = _threads(ios[eng], pool, phase, keys, part)
                    elif phase == "store":
                        status = ring.store_all(keys, part)
                    else:
                        status = ring.load_all(keys, part)
                    c1, t1 = _cpu(), time.perf_counter()
                    for k, v in enumerate((t1 - t0, c1[0] - c0[0], c1[1] - c0[1])):
                        acc[eng][k] += v
                    bad = [s for s in status if s != 2]
                    if bad:
                        raise SystemExit(f"{eng} {phase}: {len(bad)} failed, e.g. {bad[:5]}")
                    if phase == "load":
                        lo, hi = r0 * row, (r0 + len(keys)) * row
                        if dv[lo:hi] != sv[lo:hi]:
                            raise SystemExit(f"{eng} load: rows differ from the source")
                        dv[lo:hi] = bytes(hi - lo)
            if ring is not None:
                ring.close()
            pool.shutdown()
            for eng in engines:
                wall, usr, sys_ = acc[eng]
                res.setdefault((eng, phase), []).append(
                    (gb / wall, (usr + sys_) / gb, usr / gb, sys_ / gb)
                )
                print(
                    f"rep {rep} {eng:12s} {phase}: {gb / wall:.2f} GB/s, "
                    f"{(usr + sys_) / gb:.2f} CPU s/GB (usr {usr / gb:.2f}, sys {sys_ / gb:.2f})",
                    flush=True,
                )
        for eng in roots:
            shutil.rmtree(roots[eng][0], ignore_errors=True)
    print(f"\n{n} chunks of {a.chunk_kib} KiB, medians of {a.reps}:")
    for phase in ("store", "load"):
        for eng in engines:
            v = res[(eng, phase)]
            print(
                f"  {phase:5s} {eng:12s} {statistics.median(x[0] for x in v):.2f} GB/s  "
                f"{statistics.median(x[1] for x in v):.2f} CPU s/GB (usr "
                f"{statistics.median(x[2] for x in v):.2f}, sys "
                f"{statistics.median(x[3] for x in v):.2f})"
            )


if __name__ == "__main__":
    main()
