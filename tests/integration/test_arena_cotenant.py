"""CASES C44: another local user's segments in /dev/shm, against sweeping and attaching.

A real second user (``tests/cotenant.py``: ``kvoffload-cotenant``) creates the segments, holds
their locks and reads them, in a forked child that runs as that user; the engine side runs in the
test process (root) or, where the case is a non-root engine, as the co-tenant with root's segments
in its way. Segments that no engine may sweep away during a test (other test runs sweep /dev/shm
at every engine start) are either held (a live owner lock) or named outside the ``kvoffload``
prefix and swept by that prefix, as tests/integration/test_arena.py's C15 janitor test does.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import logging
import os
import stat
import time

import pytest
from cotenant import COTENANT, CotenantProcess, as_cotenant, cotenant
from helpers import arena_name, vllm_installed

from kvoffload.ipc import arena as arena_mod
from kvoffload.ipc.arena import (
    HEADER_BYTES,
    Arena,
    ArenaForeignError,
    list_arenas,
    sweep_report,
    unlink_if_orphaned,
)
from kvoffload.tools.cli import main

SLOTS, ROW = 4, 4096
SIZE = HEADER_BYTES + SLOTS * ROW
VICTIM = "victim-engine"


def _name(tag: str, prefix: str = "kvoffload") -> str:
    return f"{prefix}_c44_{tag}_{os.getpid()}_{time.monotonic_ns()}"


def _squat(
    conn, name: str, mode: int, hold_lock: bool, nonce: bytes, slots: int, row: int, engine: str
) -> None:
    """The co-tenant's side: pre-create ``name`` with ``mode`` and a valid, ready header naming
    the victim's engine (the header format is in the source), optionally hold its owner lock (a
    live "owner"), say ``ready``; when told, send back every byte after the header (what it can
    read of anything the victim wrote), remove the segment, return."""
    path = os.path.join(arena_mod.SHM_DIR, name)
    size = HEADER_BYTES + slots * row
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have taken bits away
        os.ftruncate(fd, size)
        header = arena_mod._HEADER.pack(
            arena_mod._MAGIC,
            arena_mod._VERSION,
            arena_mod._STATE_READY,
            os.getpid(),
            time.time_ns(),
            slots,
            row,
            nonce,
            engine.encode(),
        )
        os.pwrite(fd, header, 0)
        if hold_lock:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        conn.send("ready")
        conn.recv()
        conn.send(os.pread(fd, size - HEADER_BYTES, HEADER_BYTES))
    finally:
        os.close(fd)
        os.unlink(path)


@contextlib.contextmanager
def squatter(
    name: str,
    mode: int = 0o600,
    hold_lock: bool = True,
    nonce: bytes = b"n" * 16,
    slots: int = SLOTS,
    row: int = ROW,
    engine: str = VICTIM,
):
    """A co-tenant's segment ``name`` (``slots`` x ``row`` bytes, a header naming ``engine``)
    for the duration of the block; yields a function that returns what the co-tenant reads
    after the header (call it last: the segment then goes)."""
    with CotenantProcess(_squat, name, mode, hold_lock, nonce, slots, row, engine) as proc:
        assert proc.recv() == "ready"
        taken: list[bytes] = []

        def read_back() -> bytes:
            proc.send("read")
            taken.append(proc.recv())
            return taken[0]

        try:
            yield read_back
        finally:
            if not taken:
                read_back()
    assert not os.path.exists(os.path.join(arena_mod.SHM_DIR, name))


@contextlib.contextmanager
def arena_log():
    """The messages the arena module logs in the block (a handler of its own: the ``kvoffload``
    logger stops propagation once an engine has set up logging in this process)."""
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger("kvoffload.ipc.arena")
    handler, level = Keep(logging.WARNING), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _cli(*args: str) -> tuple[int, str]:
    """``kvoffload ARGS`` in this process (or the co-tenant's child): exit status and stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main.main(list(args), prog_name="kvoffload", standalone_mode=False)
            code = 0
        except SystemExit as e:
            code = int(e.code or 0)
    return code, out.getvalue()


# -- sweeping -----------------------------------------------------------------------------------


def test_c44_sweep_leaves_another_users_segments_alone_and_logs_each_once():
    """Segments of another user, one whose owner is gone and one held by a live process: the
    sweep of an engine start (root here, which could open and unlink them) skips both, counts
    them and logs each once however many starts sweep; both are still there, and the engine
    starts."""
    prefix = _name("sweep", prefix="kvtest")
    uid = cotenant().pw_uid
    with squatter(f"{prefix}_dead", hold_lock=False), squatter(f"{prefix}_live"):
        with arena_log() as messages:
            reports = [sweep_report(prefix) for _ in range(3)]  # three engine starts
        for report in reports:
            assert report.removed == []
            assert {(s.name, s.uid) for s in report.skipped} == {
                (f"{prefix}_dead", uid),
                (f"{prefix}_live", uid),
            }
        logged = [m for m in messages if prefix in m]
        assert len(logged) == 2, logged
        assert all(f"uid {uid} ({COTENANT})" in m and "not ours" in m for m in logged)
        for suffix in ("_dead", "_live"):
            assert os.path.exists(f"/dev/shm/{prefix}{suffix}")
        with Arena.open_or_create(arena_name(), SLOTS, ROW, engine_id="e") as own:
            assert own.owner


def test_c44_kvoffload_sweep_lists_another_users_segment_as_not_ours():
    """``kvoffload sweep --list`` names a co-tenant's segment as not ours with its owner uid and
    mode; ``kvoffload sweep`` exits 0, says it skipped it, and leaves it."""
    name = _name("cli")
    uid = cotenant().pw_uid
    with squatter(name, mode=0o600):
        code, listing = _cli("sweep", "--list")
        assert code == 0
        line = next(x for x in listing.splitlines() if x.startswith(name))
        assert f"not ours (owner uid {uid}, mode 0600" in line
        code, out = _cli("sweep")
        assert code == 0
        assert f"skipped {name}: not ours (owned by uid {uid} ({COTENANT})" in out
        assert "skipped (not ours)" in out.splitlines()[-1]
        assert os.path.exists(f"/dev/shm/{name}")


def _sweep_and_start(prefix: str, own: str) -> tuple[list[str], list[tuple[str, int, str]], bool]:
    """A non-root engine's start: sweep, then create its own arena (no janitor: the co-tenant
    cannot start this virtualenv's interpreter). What the sweep did, and whether it started."""
    report = sweep_report(prefix)
    with Arena.create(own, SLOTS, ROW, engine_id="cotenant-engine", janitor=False) as arena:
        started = arena.owner and stat.S_IMODE(os.stat(f"/dev/shm/{own}").st_mode) == 0o600
    return report.removed, [(s.name, s.uid, s.reason) for s in report.skipped], started


def test_c44_a_non_root_engine_start_is_not_stopped_by_another_users_segment():
    """A non-root engine start (the co-tenant's) with another user's 0600 segment under the
    package's prefix, which it cannot even open: its sweep skips it (no PermissionError) and it
    starts; its ``kvoffload sweep`` exits 0; the janitor's unlink refuses it quietly."""
    _cli("sweep", "--list")  # imports what the command needs: the co-tenant cannot read the venv
    mine = _name("root")
    with Arena.create(mine, SLOTS, ROW, engine_id="root-engine", janitor=False) as arena:
        own = _name("own")
        removed, skipped, started = as_cotenant(_sweep_and_start, mine, own)
        assert started and removed == []
        assert [(n, u) for n, u, _ in skipped] == [(mine, 0)]
        assert "permission denied" in skipped[0][2]
        assert not os.path.exists(f"/dev/shm/{own}")
        code, out = as_cotenant(_cli, "sweep")
        assert code == 0 and f"skipped {mine}: not ours" in out
        assert as_cotenant(unlink_if_orphaned, mine, arena.nonce) is False
        assert os.path.exists(f"/dev/shm/{mine}")


def test_c44_the_janitor_never_removes_another_users_segment_under_its_arenas_name():
    """The janitor of a dead engine finds its arena's name (and nonce) on another user's
    segment whose owner is gone: it leaves it."""
    name = _name("janitor", prefix="kvtest")
    nonce = os.urandom(16)
    with squatter(name, hold_lock=False, nonce=nonce):
        assert unlink_if_orphaned(name, nonce) is False
        assert os.path.exists(f"/dev/shm/{name}")


# -- attaching ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o666, 0o600], ids=["0666", "0600"])
def test_c44_a_squatters_segment_under_a_fixed_arena_name_is_refused(mode):
    """A co-tenant pre-creates the engine's fixed ``arena_name`` (a ready header naming the
    engine, its lock held as by a live owner): the engine's start fails with an error naming the
    segment, its owner uid and mode, and what to do; the squatter reads nothing from it."""
    name = _name("fixed")
    uid = cotenant().pw_uid
    with squatter(name, mode=mode) as read_back:
        with pytest.raises(ArenaForeignError) as err:
            arena = Arena.open_or_create(name, SLOTS, ROW, engine_id=VICTIM)
            arena.rows[:] = 0x5A  # what a start that attached would go on to write
            arena.close()
        msg = str(err.value)
        assert f"/dev/shm/{name}" in msg
        assert f"owner uid {uid} ({COTENANT})" in msg and f"mode {mode:04o}" in msg
        assert "pick another arena_name" in msg
        assert read_back() == bytes(SIZE - HEADER_BYTES)


def _open_or_create(name: str) -> str:
    try:
        Arena.open_or_create(name, SLOTS, ROW, engine_id=VICTIM).close()
    except ArenaForeignError as e:
        return str(e)
    return "attached"


def test_c44_a_non_root_engine_refuses_a_segment_it_cannot_open():
    """A non-root engine whose fixed name is held by another user's 0600 segment: refused,
    naming that owner (root here), not a bare permission error."""
    name = _name("rootheld")
    with Arena.create(name, SLOTS, ROW, engine_id=VICTIM, janitor=False):
        msg = as_cotenant(_open_or_create, name)
    assert msg.startswith(f"arena {name!r}") and "owner uid 0 (root), mode 0600" in msg
    assert "permission denied" in msg and "pick another arena_name" in msg


def test_c44_own_segment_readable_by_others_is_not_attached():
    """This user's own segment, widened to 0644 after creation: not attached (a reader of
    another uid could see every row)."""
    name = arena_name()
    with Arena.create(name, SLOTS, ROW, engine_id="e", janitor=False) as owner:
        os.chmod(f"/dev/shm/{name}", 0o644)
        for attach in (
            lambda: Arena.attach(name, nonce=owner.nonce),
            lambda: Arena.open_or_create(name, SLOTS, ROW, engine_id="e"),
        ):
            with pytest.raises(ArenaForeignError, match=r"mode 0644: readable or writable"):
                attach()


def test_c44_another_engines_arena_under_the_same_name_is_not_attached():
    """Two engines of one user configured with one ``arena_name``: the second is refused, naming
    the engine the arena belongs to, instead of sharing its slots."""
    name = arena_name()
    with Arena.create(name, SLOTS, ROW, engine_id="engine-a", janitor=False):
        with pytest.raises(ArenaForeignError, match="belongs to engine 'engine-a'.*engine-b"):
            Arena.open_or_create(name, SLOTS, ROW, engine_id="engine-b")
        same = Arena.open_or_create(name, SLOTS, ROW, engine_id="engine-a")
        try:
            assert not same.owner  # the legitimate attach of the engine's other process
        finally:
            same.close()


def test_created_arenas_are_mode_0600_whatever_the_umask():
    old = os.umask(0)
    try:
        with Arena.create(arena_name(), SLOTS, ROW, janitor=False) as a:
            assert stat.S_IMODE(os.stat(f"/dev/shm/{a.name}").st_mode) == 0o600
    finally:
        os.umask(old)


@pytest.mark.skipif(not vllm_installed(), reason="needs vLLM (the vllm extra)")
def test_c44_a_vllm_engine_start_with_a_squatted_fixed_arena_name_fails_naming_the_owner():
    """Through the vLLM plug-in: the scheduler's start (``get_manager``: the sweep, then the
    arena) with a fixed ``arena_name`` a co-tenant squats (0666, a live lock, a header naming
    this engine) stops with the error naming the owner; the squatter reads nothing."""
    from integration.test_event_content import EXTRA, _offloading_config
    from kvoffload.vllm import KVOffloadSpec

    name = _name("spec")
    uid = cotenant().pw_uid
    config = _offloading_config({**EXTRA, "cpu_bytes_to_use": 4 * 2 * 4096 * 3, "arena_name": name})
    spec = KVOffloadSpec(config)
    shape = {"slots": spec.num_slots, "row": spec.row_bytes, "engine": config.engine_id}
    with squatter(name, mode=0o666, **shape) as read_back:
        with pytest.raises(ArenaForeignError, match=f"owner uid {uid} .*mode 0666"):
            spec.get_manager()
        assert read_back() == bytes(spec.num_slots * spec.row_bytes)


def _listed(prefix: str) -> list[tuple[str, bool, int]]:
    return [(a.name, a.ours, a.size_bytes) for a in list_arenas(prefix)]


def test_another_users_segment_is_listed_with_its_size_even_when_it_cannot_be_opened():
    """``kvoffload sweep --list`` by a user who cannot open another's segment (the co-tenant,
    looking at root's 0600 arena) shows its size from the directory entry, not 0."""
    with Arena.create(arena_name(), SLOTS, ROW, janitor=False) as a:
        size = os.stat(f"/dev/shm/{a.name}").st_size
        assert as_cotenant(_listed, a.name) == [(a.name, False, size)]
