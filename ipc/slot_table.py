"""The host arena's self-describing slot table: which chunk each slot holds, for a warm restart.

::

    table page (4096 bytes)                      one entry per slot (128 bytes)
    ┌─────────────────────────────────────┐      ┌────────────────────────────────────────────┐
    │ magic, version, num_slots,          │      │ seq u32 · state u8 · key_len u8 · pad      │  0
    │ row_bytes, namespace id (64 bytes), │      │ stamp u64 (publication order)              │  8
    │ check: xxh3-64 of the fields        │      │ key (at most 64 bytes, zero padded)        │ 16
    └─────────────────────────────────────┘      │ entry check: xxh3-64 of bytes 0..80        │ 80
                                                 │ seal seq u32 · pad                         │ 88
                                                 │ seal digest: xxh3-64 of the slot's row     │ 96
                                                 │ seal check: xxh3-64 of seal + entry check  │ 104
                                                 └────────────────────────────────────────────┘

Three writers, each owning its fields, none waiting for another (DESIGN.md "Warm restart"):

- The **engine** (the host tier's slot table, :class:`kvoffload.host.HostTier`, one thread)
  *publishes* an entry when a slot's write is complete (READY: its bytes all landed) and
  *retracts* it before the slot is given to another write (evicted, cleared, a failed write). A
  change makes ``seq`` odd, writes the fields, makes it even again and writes the entry check last;
  an entry torn by a crash fails its check. The retraction is written before the engine tells any
  process to write the slot (a message after it), so a slot whose bytes may be changing never has
  a valid READY entry.
- The **keeper** (the arena's janitor with ``warm_restart_s``) *seals* READY entries in the
  background: it reads a stable entry, hashes the slot's row, reads the entry again, and only if it
  did not change writes the digest with the entry's ``seq`` and a check that binds both to the
  entry. The engine never hashes a row, so sealing costs its thread nothing. Once every process of
  a dead engine has unmapped the segment, the keeper seals what is left, for a bounded time
  (:func:`kvoffload.ipc.janitor.final_seal`): an entry published READY, intact and stable names a
  whole row (published only once its bytes all landed, retracted before any reuse), and nothing
  writes it any more.
- A new engine *adopts* the table once no process of the old one is left (nothing writes then): a
  slot is adopted when its entry check holds, it is READY, its seal names the entry's ``seq`` and
  its check holds, the row hashes to the sealed digest, the table's namespace is the new engine's,
  and no other adopted slot has its key. Everything else is dropped, counted by reason
  (:data:`DROP_REASONS`; a table of another namespace, or with a torn header, drops every READY
  entry: :data:`TABLE_DROP_REASONS`). Unsealed chunks are those the keeper's final seal did not
  reach within its bound.

The checks are xxh3-64 (``xxhash``): they catch torn and stale writes and bytes changed after the
seal, not an attacker (the segment is mode 0600, this user's: CASES C44). Imports nothing of the
project outside :mod:`kvoffload.ipc`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np
import xxhash

TABLE_HEADER_BYTES = 4096
ENTRY_BYTES = 128
MAX_KEY_BYTES = 64
#: A chunk key ends with its 4-byte KV-group index (DESIGN.md "Keys and namespaces"): a key of
#: this many bytes or fewer names no block and is never adopted.
GROUP_BYTES = 4
#: Why :meth:`SlotTable.adopt` dropped a slot: its entry torn, READY but not sealed (or its seal
#: not of this entry), its row not the sealed digest, its key in two slots, a key too short to
#: name a chunk (at most :data:`GROUP_BYTES`: no block hash before the KV-group index).
DROP_REASONS = ("torn", "unsealed", "digest", "duplicate", "key")
#: Why a whole table was not adopted, every READY entry in it dropped: another namespace's, or
#: its header torn or missing (:meth:`SlotTable.ready_entries` counts them).
TABLE_DROP_REASONS = ("namespace", "table")
#: A warm restart's outcome for each chunk it found: the ``outcome`` label of
#: ``kvoffload_warm_restart_chunks_total`` (docs/observability.md).
OUTCOMES = ("adopted", *(f"dropped_{r}" for r in DROP_REASONS + TABLE_DROP_REASONS))

_MAGIC = b"KVOSLOTS"
_VERSION = 1
_FREE, _READY = 0, 1
# magic, version, num_slots, row_bytes, namespace id (ascii, zero padded)
_TABLE = struct.Struct("<8sIQQ64s")
_ENTRY = struct.Struct("<IBBHQ64s")  # seq, state, key_len, pad, stamp, key: bytes 0..80
_CHECK_AT = _ENTRY.size  # 80
_SEAL = struct.Struct("<IIQ")  # seal seq, pad, digest: bytes 88..104
_SEAL_AT = 88
_SEAL_CHECK_AT = 104
assert _ENTRY.size == 80 and _SEAL_AT + _SEAL.size == _SEAL_CHECK_AT


def table_bytes(num_slots: int, page: int = 4096) -> int:
    """Bytes the table of ``num_slots`` slots takes, page rounded."""
    n = TABLE_HEADER_BYTES + num_slots * ENTRY_BYTES
    return -(-n // page) * page


def _h(b) -> int:
    return xxhash.xxh3_64_intdigest(b)


def header_namespace(head, num_slots: int, row_bytes: int) -> str | None:
    """The namespace id a table header (``head``: the table's first bytes, at least
    ``TABLE_HEADER_BYTES``) was formatted for, None when it is not a valid header of a table of
    ``num_slots`` rows of ``row_bytes``."""
    mv = memoryview(head).cast("B")
    if len(mv) < _TABLE.size + 8:
        return None
    raw = bytes(mv[: _TABLE.size])
    (check,) = struct.unpack_from("<Q", mv, _TABLE.size)
    if check != _h(raw):
        return None
    magic, version, n, r, ns = _TABLE.unpack(raw)
    if (magic, version, n, r) != (_MAGIC, _VERSION, num_slots, row_bytes):
        return None
    return ns.rstrip(b"\0").decode("ascii", "replace")


class SlotTableError(Exception):
    """The table region does not hold a table of this shape and namespace (it is not adopted)."""


@dataclass
class Adoption:
    """What :meth:`SlotTable.adopt` found: ``slots`` (key -> slot, in publication order, oldest
    first) and ``dropped`` (reason -> slots not adopted, every reason of :data:`DROP_REASONS`)."""

    slots: dict[bytes, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))


class SlotTable:
    """The slot table over ``buf`` (a writable buffer of :func:`table_bytes` bytes inside the
    arena's segment) for ``rows`` (the arena's ``(num_slots, row_bytes)`` uint8 view).

    The engine calls :meth:`format` (a new table) or :meth:`adopt`, then :meth:`publish` and
    :meth:`retract` from one thread; the keeper calls :meth:`seal_pending`.
    """

    def __init__(self, buf, rows: np.ndarray):
        self.mv = memoryview(buf).cast("B")
        self.rows = rows
        self.num_slots, self.row_bytes = rows.shape
        if len(self.mv) < table_bytes(self.num_slots):
            raise SlotTableError(
                f"slot table region of {len(self.mv)} bytes, {self.num_slots} slots need "
                f"{table_bytes(self.num_slots)}"
            )
        self._stamp = 0
        self._seal_from = 0  # the keeper's next pass starts at this slot
        # seq and seal seq of every entry, for the keeper's scan (strided views, no copy)
        entries = np.frombuffer(
            self.mv, dtype=np.uint8, count=self.num_slots * ENTRY_BYTES, offset=TABLE_HEADER_BYTES
        ).reshape(self.num_slots, ENTRY_BYTES)
        words = entries.view(np.uint32)
        self._seqs = words[:, 0]
        self._states = entries[:, 4]
        self._seal_seqs = words[:, _SEAL_AT // 4]

    # -- the table header ---------------------------------------------------------------------

    def _header(self, namespace_id: str) -> bytes:
        return _TABLE.pack(
            _MAGIC, _VERSION, self.num_slots, self.row_bytes, namespace_id.encode("ascii")
        )

    def format(self, namespace_id: str) -> None:
        """Start an empty table for ``namespace_id`` (every entry FREE, unsealed)."""
        self.mv[:TABLE_HEADER_BYTES] = bytes(TABLE_HEADER_BYTES)
        self.mv[TABLE_HEADER_BYTES : TABLE_HEADER_BYTES + self.num_slots * ENTRY_BYTES] = bytes(
            self.num_slots * ENTRY_BYTES
        )
        head = self._header(namespace_id)
        self.mv[: len(head)] = head
        struct.pack_into("<Q", self.mv, len(head), _h(head))
        self._stamp = 0

    def namespace_id(self) -> str | None:
        """The namespace id the table was formatted for, or None when the header is not a valid
        table header of this shape."""
        return header_namespace(self.mv[:TABLE_HEADER_BYTES], self.num_slots, self.row_bytes)

    # -- the engine's writes ------------------------------------------------------------------

    def _write(self, slot: int, state: int, key: bytes, stamp: int) -> None:
        at = TABLE_HEADER_BYTES + slot * ENTRY_BYTES
        mv = self.mv
        (old,) = struct.unpack_from("<I", mv, at)
        seq = ((old | 1) + 1) & 0xFFFFFFFF  # even: the next stable value
        _ENTRY.pack_into(mv, at, (seq - 1) & 0xFFFFFFFF, state, len(key), 0, stamp, key)  # odd
        struct.pack_into("<I", mv, at, seq)
        struct.pack_into("<Q", mv, at + _CHECK_AT, _h(mv[at : at + _CHECK_AT]))

    def publish(self, slot: int, key: bytes) -> None:
        """``slot`` holds ``key``'s chunk, all its bytes written (READY). A key longer than
        :data:`MAX_KEY_BYTES` is not recorded (the slot stays FREE: never adopted)."""
        if len(key) > MAX_KEY_BYTES:
            self.retract(slot)
            return
        self._stamp += 1
        self._write(slot, _READY, key, self._stamp)

    def retract(self, slot: int) -> None:
        """``slot`` no longer holds a READY chunk: called before any process is told to write it."""
        self._write(slot, _FREE, b"", 0)

    # -- the keeper ---------------------------------------------------------------------------

    def _entry(self, slot: int) -> tuple[int, int, bytes, int, int] | None:
        """(seq, state, key, stamp, entry check) of a stable, intact entry, else None."""
        at = TABLE_HEADER_BYTES + slot * ENTRY_BYTES
        raw = bytes(self.mv[at : at + _CHECK_AT + 8])
        if not any(raw):
            return 0, _FREE, b"", 0, 0  # never written since the table was formatted
        (check,) = struct.unpack_from("<Q", raw, _CHECK_AT)
        if check != _h(raw[:_CHECK_AT]):
            return None
        seq, state, key_len, _, stamp, key = _ENTRY.unpack_from(raw)
        if seq & 1 or key_len > MAX_KEY_BYTES:
            return None
        return seq, state, key[:key_len], stamp, check

    def seal_pending(self, limit: int | None = None) -> int:
        """Seal READY entries whose seal does not name their current ``seq`` (at most ``limit``
        of them, from the slot after the last pass's: an entry that cannot be sealed, torn or
        changing, does not hold the others back): hash each one's row and record the digest if
        the entry did not change meanwhile. Returns how many were sealed."""
        pending = np.flatnonzero((self._seqs != self._seal_seqs) & (self._states == _READY))
        if limit is not None and len(pending) > limit:  # from where the last pass stopped
            first = int(np.searchsorted(pending, self._seal_from))
            pending = np.roll(pending, -first)[:limit]
        if len(pending):
            self._seal_from = int(pending[-1]) + 1
        sealed = 0
        for slot in pending.tolist():
            entry = self._entry(slot)
            if entry is None or entry[1] != _READY:
                continue
            digest = _h(self.rows[slot])
            if self._entry(slot) != entry:
                continue  # retracted or republished while hashed: the digest may be of anything
            at = TABLE_HEADER_BYTES + slot * ENTRY_BYTES
            seal = _SEAL.pack(entry[0], 0, digest)
            self.mv[at + _SEAL_AT : at + _SEAL_CHECK_AT] = seal
            struct.pack_into(
                "<Q", self.mv, at + _SEAL_CHECK_AT, _h(seal + struct.pack("<Q", entry[4]))
            )
            sealed += 1
        return sealed

    # -- a new engine -------------------------------------------------------------------------

    def ready_entries(self) -> int:
        """Entries that read READY, stable and intact, whatever the table's header says: the
        chunks a table that is not adopted drops."""
        ready = np.flatnonzero(self._states == _READY).tolist()
        return sum(1 for slot in ready if (e := self._entry(slot)) is not None and e[1] == _READY)

    def adopt(self, namespace_id: str) -> Adoption:
        """The READY, sealed, intact chunks of a table left by a dead engine of ``namespace_id``
        (nothing may write the table or the rows meanwhile). The table is the caller's then: every
        entry not adopted is cleared (FREE), and publication stamps continue after the adopted
        ones.

        Raises:
            SlotTableError: the header is not a table of this shape, or names another namespace
                (nothing is adopted: the caller formats a new table).
        """
        found = self.namespace_id()
        if found is None:
            raise SlotTableError("the arena's slot table header is missing or torn")
        if found != namespace_id:
            raise SlotTableError(
                f"the arena's chunks are of namespace {found}, this engine's is {namespace_id}"
            )
        out = Adoption()
        by_key: dict[bytes, tuple[int, int]] = {}  # key -> (stamp, slot)
        dups: set[bytes] = set()
        for slot in range(self.num_slots):
            at = TABLE_HEADER_BYTES + slot * ENTRY_BYTES
            entry = self._entry(slot)
            if entry is None:
                out.dropped["torn"] += 1
                continue
            seq, state, key, stamp, check = entry
            if state != _READY:
                continue  # a free slot: nothing to adopt
            if len(key) <= GROUP_BYTES:
                out.dropped["key"] += 1
                continue
            seal = bytes(self.mv[at + _SEAL_AT : at + _SEAL_CHECK_AT])
            (seal_check,) = struct.unpack_from("<Q", self.mv, at + _SEAL_CHECK_AT)
            seal_seq, _, digest = _SEAL.unpack(seal)
            if seal_seq != seq or seal_check != _h(seal + struct.pack("<Q", check)):
                out.dropped["unsealed"] += 1
                continue
            if _h(self.rows[slot]) != digest:
                out.dropped["digest"] += 1
                continue
            if key in by_key:
                dups.add(key)
                out.dropped["duplicate"] += 1
                continue
            by_key[key] = (stamp, slot)
        for key in dups:  # which copy is right cannot be known: none is adopted
            del by_key[key]
            out.dropped["duplicate"] += 1
        for key, (stamp, slot) in sorted(by_key.items(), key=lambda kv: kv[1][0]):
            out.slots[key] = slot
            self._stamp = max(self._stamp, min(stamp, 1 << 62))  # a wild stamp cannot overflow
        adopted = set(out.slots.values())
        for slot in range(self.num_slots):  # the table is this engine's now: the rest is free
            at = TABLE_HEADER_BYTES + slot * ENTRY_BYTES
            if slot not in adopted and any(self.mv[at : at + ENTRY_BYTES]):
                self._write(slot, _FREE, b"", 0)
        return out
