"""Wire schema between the engine and tier worker processes: msgspec tagged structs, msgpack-encoded.

::

    engine ──Task (StoreTask | LoadTask | ProbeTask | DeleteTask | ScanTask | StopTask)──▶ worker
    worker ──Hello──────────────────────────────────────────────────────────▶ engine   (jobs socket)
    worker ──TaskResult─────────────────────────────────────────────────────▶ engine   (results socket)

Tasks carry arena slot indices and chunk keys, never payload bytes: bytes move between the arena and
storage inside the worker. Every task gets exactly one :class:`TaskResult` from the worker that ran
it; a task whose worker dies is failed or re-run by the engine (tasks are idempotent).

Per-key outcome codes (``TaskResult.codes``) are the ``CODE_*`` constants below.
"""

from __future__ import annotations

import msgspec

# Per-key outcome codes.
OK = 0
MISSING = 1  # the chunk is not in the tier (probe: absent; load: file/object not found)
CORRUPT = 2  # verified corruption: short payload, wrong header, bad checksum (the copy was removed)
IO_ERROR = 3  # transient I/O failure (EIO, timeouts, 5xx): the stored copy is left alone
NO_SPACE = 4  # the tier is full (ENOSPC, quota)
TIMEOUT = 5  # the job ran past its deadline (set by the engine, never by a worker)
WORKER_DIED = 6  # the worker holding the job died (set by the engine)
CANCELLED = 7  # the tier shut down before the job ran (set by the engine)
REJECTED = 8  # the request was refused (HTTP 4xx other than 404, permissions)

CODE_NAMES = {
    OK: "ok",
    MISSING: "missing",
    CORRUPT: "corrupt",
    IO_ERROR: "io_error",
    NO_SPACE: "no_space",
    TIMEOUT: "timeout",
    WORKER_DIED: "worker_died",
    CANCELLED: "cancelled",
    REJECTED: "rejected",
}


class StoreTask(msgspec.Struct, tag="store", array_like=True, gc=False):
    """Copy arena rows ``slots[i]`` to the tier under ``keys[i]``."""

    task_id: int
    slots: list[int]
    keys: list[bytes]


class LoadTask(msgspec.Struct, tag="load", array_like=True, gc=False):
    """Copy the tier's chunk ``keys[i]`` into arena row ``slots[i]``, verified."""

    task_id: int
    slots: list[int]
    keys: list[bytes]


class ProbeTask(msgspec.Struct, tag="probe", array_like=True, gc=False):
    """Report whether each of ``keys`` exists in the tier (``OK`` present, ``MISSING`` absent)."""

    task_id: int
    keys: list[bytes]


class DeleteTask(msgspec.Struct, tag="delete", array_like=True, gc=False):
    """Remove ``keys`` from the tier (eviction). Missing keys are not an error."""

    task_id: int
    keys: list[bytes]


class ScanTask(msgspec.Struct, tag="scan", array_like=True, gc=False):
    """Remove orphaned temporary files of dead writers and, with ``list_entries``, list the tier's
    chunks of this namespace (for capacity accounting) in ``TaskResult.entries``."""

    task_id: int
    list_entries: bool = True


class StopTask(msgspec.Struct, tag="stop", array_like=True, gc=False):
    """The engine is shutting down this worker: exit now (no result)."""

    task_id: int = 0


Task = StoreTask | LoadTask | ProbeTask | DeleteTask | ScanTask | StopTask


class Hello(msgspec.Struct, tag="hello", array_like=True, gc=False):
    """First message of a worker on its jobs socket: it is ready for tasks."""

    worker_id: int
    pid: int


class TaskResult(msgspec.Struct, tag="result", array_like=True, gc=False):
    """Outcome of one task.

    Attributes:
        task_id: the task's id.
        worker_id: the worker that ran it.
        codes: one outcome code per key of the task, in task order.
        detail: first error message, empty on success.
        nbytes: payload bytes moved (bytes).
        seconds: time spent in I/O (seconds).
        entries: ``ScanTask`` only: ``(key, stored bytes, mtime seconds)`` per chunk found.
        status: optional per-key protocol status (e.g. HTTP status), 0 where not applicable.
        counters: the worker's own counts since its previous result (:mod:`kvoffload.workers.counters`).
    """

    task_id: int
    worker_id: int
    codes: list[int]
    detail: str = ""
    nbytes: int = 0
    seconds: float = 0.0
    entries: list[tuple[bytes, int, float]] = []
    status: list[int] = []
    counters: dict[str, float] = {}


_task_encoder = msgspec.msgpack.Encoder()
_task_decoder = msgspec.msgpack.Decoder(Task)
_reply_decoder = msgspec.msgpack.Decoder(Hello | TaskResult)


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack bytes of a task, hello or result."""
    return _task_encoder.encode(msg)


def decode_task(data: bytes) -> Task:
    """Decode a task sent by the engine.

    Raises:
        msgspec.DecodeError: malformed or unknown message.
    """
    return _task_decoder.decode(data)


def decode_reply(data: bytes) -> Hello | TaskResult:
    """Decode a worker's hello or result.

    Raises:
        msgspec.DecodeError: malformed or unknown message.
    """
    return _reply_decoder.decode(data)


class Fault(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A fault to inject at a named point of a tier worker (tests).

    Attributes:
        point: where: ``task`` (any task, before any work), ``store`` / ``load`` / ``probe`` /
            ``delete`` / ``scan`` (a task of that kind, before any work), ``before_read_slot``
            (store, before the arena is read), ``before_publish`` (store, before the atomic
            rename), ``after_metadata_before_read`` (load, after the header was checked),
            ``read_payload`` (load, the payload read), ``probe_key`` (each key of a probe),
            ``reply`` (any task with keys, its result about to be sent; for ``mangle``),
            ``reply_store`` / ``reply_load`` / ``reply_probe`` / ``reply_delete`` (the same, for
            one kind of task).
        action: ``sleep`` (``arg`` seconds), ``raise`` (OSError with errno ``arg``, e.g. 5 = EIO),
            ``drop`` (never answer the task), ``exit`` (the worker process exits at once),
            ``wait_file`` (block until the file ``arg`` exists, at most 120 s; on reaching the point
            the worker first appends its pid to ``<arg>.reached``, so a test can wait until it is
            paused there), ``mangle`` (point ``reply``: send a malformed result, ``arg`` one of
            ``kvoffload.workers.faults.MANGLE_KINDS``: a short or empty code list, ...).
        key_hex: only for chunk keys whose hex starts with this; None matches all.
        count: how many times it fires; -1 for always.
        arg: the action's argument.
    """

    point: str
    action: str
    key_hex: str | None = None
    count: int = 1
    arg: str | float | int | None = None


class WorkerSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Everything a tier worker process needs, passed to it at spawn (JSON in an environment
    variable)."""

    tier_name: str
    worker_id: int
    identity: bytes
    kind: str  # "loads" (reader) or "stores" (writer)
    arena_name: str
    arena_nonce: bytes
    jobs_endpoint: str
    results_endpoint: str
    parent_pid: int
    nice: int = 10
    io_threads: int = 1
    io_module: str
    io_config: dict = {}
    faults: list[Fault] = []
