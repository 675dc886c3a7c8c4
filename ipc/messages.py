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

import errno
from typing import Annotated, Literal

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
ERROR = 9  # the worker's code raised something unexpected (a bug, an out-of-tree I/O module's
#            error; CASES C25): that key failed, the worker goes on; its stored copy is left alone
BAD_REPLY = 10  # the worker's reply did not answer this key (set by the engine, CASES C24)
FORGED = 11  # the tier has an integrity key and the chunk's MAC is missing or wrong (removed; C43)
UNSAFE_PATH = 12  # a symbolic link (removed) or a special file where the tier's layout has its own
#                   directory or file: nothing was followed or written there (CASES C43)
TENANT_QUOTA = 13  # refused at admission: past its tenant's quota in the tier, and none of that
#                    tenant's own chunks could be evicted for it (set by the engine)

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
    ERROR: "error",
    BAD_REPLY: "bad_reply",
    FORGED: "forged",
    UNSAFE_PATH: "unsafe_path",
    TENANT_QUOTA: "tenant_quota",
}


class StoreTask(msgspec.Struct, tag="store", array_like=True, gc=False):
    """Copy arena rows ``slots[i]`` to the tier under ``keys[i]``."""

    task_id: int
    slots: list[int]
    keys: list[bytes]
    tenant: str = ""
    """The tenant whose chunks these are (a tenant id, 32 hex digits: their directory or prefix
    ``t-<tenant id>/`` below the namespace's, ``kvoffload.tenants``); "" for none."""


class LoadTask(msgspec.Struct, tag="load", array_like=True, gc=False):
    """Copy the tier's chunk ``keys[i]`` into arena row ``slots[i]``, verified."""

    task_id: int
    slots: list[int]
    keys: list[bytes]
    tenant: str = ""
    """The tenant whose chunks these are (a tenant id, 32 hex digits: their directory or prefix
    ``t-<tenant id>/`` below the namespace's, ``kvoffload.tenants``); "" for none."""


class ProbeTask(msgspec.Struct, tag="probe", array_like=True, gc=False):
    """Report whether each of ``keys`` exists in the tier (``OK`` present, ``MISSING`` absent)."""

    task_id: int
    keys: list[bytes]
    tenant: str = ""
    """The tenant whose chunks these are (a tenant id, 32 hex digits: their directory or prefix
    ``t-<tenant id>/`` below the namespace's, ``kvoffload.tenants``); "" for none."""


class DeleteTask(msgspec.Struct, tag="delete", array_like=True, gc=False):
    """Remove ``keys`` from the tier (eviction). Missing keys are not an error."""

    task_id: int
    keys: list[bytes]
    tenant: str = ""
    """The tenant whose chunks these are (a tenant id, 32 hex digits: their directory or prefix
    ``t-<tenant id>/`` below the namespace's, ``kvoffload.tenants``); "" for none."""


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
        nbytes: bytes the worker moved between arena and storage: file or object bytes written
            or read, headers included (bytes); 0 for a key that failed or was not written.
        seconds: time spent in I/O (seconds).
        entries: ``ScanTask`` only: ``(key, stored bytes, mtime seconds)`` per chunk found.
        status: optional per-key protocol status (e.g. HTTP status; for a failed delete, the
            errno), 0 where not applicable.
        counters: the worker's own counts since its previous result (:mod:`kvoffload.workers.counters`).
        free_bytes: a store task with ``NO_SPACE`` verdicts: the least free space (bytes) its
            medium showed just after one of them (``IOOutcome.free_bytes``; 0: the shortage does
            not show there); -1 when one of them was not measured, or there is none (CASES C52).
        present: a store task: its keys found already stored and not written again (chunks;
            ``IOOutcome.present``, CASES C50); counted among the ``OK`` codes.
        done_at: ``time.monotonic()`` in the worker when the task's I/O ended (seconds;
            CLOCK_MONOTONIC is one clock for every process of the machine); 0.0: not given.
            The engine reads results once per scheduler step: this says when the tier was done,
            for its throughput estimate (:mod:`kvoffload.costs`), clamped to the task's life.
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
    free_bytes: int = -1
    present: int = 0
    done_at: float = 0.0
    tenants: list[str] = []


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


FaultPoint = Literal[
    "task",
    "store",
    "load",
    "probe",
    "delete",
    "scan",
    "before_read_slot",
    "before_publish",
    "direct_open_created",
    "direct_write",
    "after_metadata_before_read",
    "read_payload",
    "direct_read",
    "probe_key",
    "unlink",
    "reply",
    "store_reply",
    "load_reply",
    "probe_reply",
    "delete_reply",
    "scan_reply",
]
"""Where a worker fires faults (see :class:`Fault`); each is a ``faults.hit(point, ...)`` call."""

FaultAction = Literal[
    "sleep",
    "raise",
    "raise_error",
    "drop",
    "exit",
    "wait_file",
    "reply_short",
    "reply_empty",
    "reply_long",
    "reply_bad_code",
    "reply_stray",
    "reply_hold",
]

FAULT_ERRORS = (
    "ValueError",
    "TypeError",
    "KeyError",
    "RuntimeError",
    "MemoryError",
    "struct.error",
)
"""Exception types a ``raise_error`` fault can raise: the failures of a bug, not of storage."""


class Fault(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A fault to inject at a named point of a tier worker (tests).

    Checked when the config is parsed: an unknown point or action, or an argument the action cannot
    use, is a config error naming the key and the allowed values (never a worker crash).

    Attributes:
        point: where: ``task`` (any task, before any work), ``store`` / ``load`` / ``probe`` /
            ``delete`` / ``scan`` (a task of that kind, before any work), ``before_read_slot``
            (store, before the arena is read), ``direct_open_created`` (store, after an O_DIRECT
            open created the temporary file: a ``raise`` of errno 22 plays a filesystem that
            creates the file, then refuses direct I/O), ``direct_write`` (store, before writing
            through an O_DIRECT descriptor: errno 22 plays a filesystem that takes the open but
            fails aligned writes), ``before_publish`` (store, before the atomic rename),
            ``after_metadata_before_read`` (load, after the header was checked),
            ``read_payload`` (load, the payload read), ``direct_read`` (load, before reading
            through an O_DIRECT descriptor), ``probe_key`` (each key of a probe), ``unlink``
            (each key of a delete, before the file is removed), ``reply`` / ``<kind>_reply`` (``store_reply``, ``load_reply``, ...: a task's result, before it is
            sent; any task or one kind).
        action: ``sleep`` (``arg`` seconds), ``raise`` (OSError with errno ``arg``, default 5 =
            EIO), ``raise_error`` (an exception that is not an I/O error, of the type named by
            ``arg``, one of :data:`FAULT_ERRORS`, default ValueError: what a bug raises),
            ``drop`` (never answer the task), ``exit`` (the worker process exits at once),
            ``wait_file`` (block until the file ``arg`` exists, at most 120 s; on reaching the point
            the worker first appends its pid to ``<arg>.reached``, so a test can wait until it is
            paused there); at a reply point only: ``reply_short``, ``reply_empty``, ``reply_long``,
            ``reply_bad_code``, ``reply_stray`` (malformed replies, CASES C24, see
            :meth:`kvoffload.workers.faults.Faults.reply`), ``reply_hold`` (the reply is held back
            and sent before the worker's next reply or when it is next idle: a result finished but
            not yet on its way when the worker crashes, CASES C25).
        key_hex: only for chunk keys whose hex (lowercase) starts with this; None matches all.
        count: how many times it fires; -1 for always.
        arg: the action's argument.

    Raises:
        ValueError: (at decoding, as ``msgspec.ValidationError``) an argument that does not fit
            the action, or a ``key_hex`` that is not lowercase hex.
    """

    point: FaultPoint
    action: FaultAction
    key_hex: str | None = None
    count: Annotated[int, msgspec.Meta(ge=-1)] = 1
    arg: str | float | int | None = None

    def __post_init__(self) -> None:
        reply_point = self.point == "reply" or self.point.endswith("_reply")
        if self.action.startswith("reply_") and not reply_point:
            raise ValueError(
                f"action: {self.action!r} works only at a reply point (reply, "
                f"store_reply, load_reply, probe_reply, delete_reply, scan_reply), "
                f"not at {self.point!r}"
            )
        why = _fault_arg_problem(self.action, self.arg)
        if why:
            raise ValueError(f"arg: {why}")
        if self.key_hex is not None and (
            not self.key_hex or self.key_hex.strip("0123456789abcdef")
        ):
            raise ValueError(f"key_hex: {self.key_hex!r} is not a lowercase hex prefix of a key")


def _fault_arg_problem(action: str, arg: object) -> str | None:
    """Why ``arg`` cannot go with fault ``action``, or None when it can."""
    if action == "sleep":
        if arg is not None and not (
            isinstance(arg, (int, float)) and not isinstance(arg, bool) and arg >= 0
        ):
            return f"{action!r} takes a number of seconds >= 0, got {arg!r}"
    elif action == "raise":
        if arg is not None and not (
            isinstance(arg, int) and not isinstance(arg, bool) and arg in errno.errorcode
        ):
            return f"{action!r} takes an errno number (e.g. 5 = EIO, 22 = EINVAL), got {arg!r}"
    elif action == "raise_error":
        if arg is not None and arg not in FAULT_ERRORS:
            return f"{action!r} takes one of {', '.join(FAULT_ERRORS)}, got {arg!r}"
    elif action == "wait_file":
        if not (isinstance(arg, str) and arg):
            return f"{action!r} takes the path of the file to wait for, got {arg!r}"
    elif arg is not None:  # drop, exit, reply_*
        return f"{action!r} takes no argument, got {arg!r}"
    return None


class WorkerSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Everything a tier worker process needs, passed to it at spawn (JSON in the environment
    variable :data:`kvoffload.ipc.names.WORKER_SPEC_ENV`).

    ``io_module`` is the worker-side module the worker imports (``kvoffload.workers.fs_io``);
    ``io_config`` the JSON of its I/O config, a tagged struct of
    :mod:`kvoffload.workers.ioconfig` (``{"io": "fs", ...}``), kept undecoded here and decoded by
    the worker as the module's ``IO_CONFIG``.
    """

    tier_name: str
    worker_id: int
    identity: bytes
    kind: str  # "loads" (reader) or "stores" (writer)
    arena_name: str
    arena_nonce: bytes
    jobs_endpoint: str
    parent_pid: int
    nice: int = 10
    io_threads: int = 1
    io_module: str
    io_config: msgspec.Raw
    faults: list[Fault] = []
