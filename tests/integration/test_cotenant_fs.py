"""CASES C43 with a real second local user: a co-tenant of a shared fs root reads, plants and
redirects, against an engine (this test process, root) whose fs tier keeps the root private (the
default) or shares it with the co-tenant's group (``share_with_group``).

::

    /tmp/kvoffload-c43-XXXXXXXX/     1777 (like /tmp): both users reach it, each makes its own
        root/ or groot/              the tier's root_dir: made 0700 by the tier, or 2770
                                     root:<co-tenant's group> by the operator, for sharing
        outside/                     the co-tenant's own directory, where its links point

The co-tenant is the local user ``kvoffload-cotenant``, created once (``useradd --system``, no
home, no login shell; a concurrent creator may win, and the user is never deleted: other tests on
this machine use the same one). Its steps are plain coreutils (``ls``, ``cat``, ``ln``, ``mkdir``,
``cp``) started with its uid and gid and no other group, so what they may do is exactly what the
kernel lets that user do. Needs root: skipped without it, failed instead with
``KVOFFLOAD_REQUIRE_NETNS=1`` (CI, which runs as root). The shared directory is removed at the end.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from cotenant import cotenant
from helpers import HIT, MISS, ROW, Rig, failed_chunks, fs_tier, keys_for, namespace, payload

from kvoffload.tools.cli import main
from kvoffload.workers import chunkfile as cf

INTEGRITY_ENV = "KVOFFLOAD_TEST_INTEGRITY_KEY"
_PATIENCE_S = 120.0


def as_cotenant(*argv: str | os.PathLike, data: bytes | None = None) -> subprocess.CompletedProcess:
    """Run ``argv`` as the co-tenant (its uid and gid, no other group, umask 022)."""
    user = cotenant()
    return subprocess.run(
        [str(a) for a in argv],
        user=user.pw_uid,
        group=user.pw_gid,
        extra_groups=[],
        umask=0o022,
        input=data,
        capture_output=True,
        timeout=_PATIENCE_S,
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"},
    )


def denied(res: subprocess.CompletedProcess) -> bool:
    return res.returncode != 0 and b"Permission denied" in res.stderr


@pytest.fixture
def shared():
    """A directory both users reach (1777, like /tmp), removed with everything in it."""
    cotenant()
    path = Path(tempfile.mkdtemp(prefix="kvoffload-c43-", dir="/tmp"))
    try:
        os.chmod(path, 0o1777)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def group_root(shared: Path) -> Path:
    """A root the operator made for sharing with the co-tenant's group: 2770, root:<group>."""
    root = shared / "groot"
    root.mkdir()
    os.chown(root, 0, cotenant().pw_gid)
    os.chmod(root, 0o2770)
    return root


def chunk_file(root: Path, rig: Rig, key: bytes) -> Path:
    return root / rig.fs.ns_id / cf.relative_name(key)


def run_cli(*args: str):
    return CliRunner().invoke(main, list(args), env={"COLUMNS": "250"})


def test_c43_a_cotenant_reads_no_chunk_and_lists_no_name_of_a_private_root(shared):
    root = shared / "root"
    keys = keys_for(3)
    old = os.umask(0o000)  # a careless umask: the tier's modes do not depend on it
    try:
        with Rig([fs_tier(root)], num_slots=4) as rig:
            rig.store(keys)
            files = [chunk_file(root, rig, k) for k in keys]
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in files)
    assert denied(as_cotenant("ls", root))
    assert denied(as_cotenant("cat", files[0]))
    # The files keep it out on their own: open every directory on the way, as an operator might.
    for d in (root, files[0].parents[2], files[0].parents[1], files[0].parent):
        os.chmod(d, 0o755)
    listed = as_cotenant("ls", files[0].parent)
    assert listed.returncode == 0 and files[0].name.encode() in listed.stdout
    assert denied(as_cotenant("cat", files[0]))
    # The operator's commands work on such a root.
    report = run_cli("inspect", str(root), "--json")
    assert report.exit_code == 0, report.output
    (ns,) = json.loads(report.output)["namespaces"]
    assert ns["chunks"] == 3 and ns["problem"] is None
    swept = run_cli("sweep", "--fs-root", str(root))
    assert swept.exit_code == 0, swept.output


def test_c43_with_share_with_group_the_group_reads_every_chunk(shared):
    """What README's fs section says ``share_with_group`` gives: the group reads (and writes)
    every chunk; setgid directories keep the root's group on everything below."""
    gid = cotenant().pw_gid
    root = group_root(shared)
    k = keys_for(1)[0]
    with Rig([fs_tier(root, share_with_group=True)], num_slots=4) as rig:
        rig.store([k])
        path = chunk_file(root, rig, k)
    for p in (path.parents[2], path.parents[1], path.parent):
        st = os.stat(p)
        assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (gid, 0o2770)
    st = os.stat(path)
    assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (gid, 0o660)
    read = as_cotenant("cat", path)
    assert read.returncode == 0 and read.stdout == path.read_bytes()
    assert read.stdout[cf.HEADER_BYTES :] == payload(k).tobytes()
    report = run_cli("inspect", str(root), "--json")
    assert report.exit_code == 0, report.output


def _plant(ns_dir: Path, key: bytes, data: bytes) -> None:
    """The co-tenant writes ``data`` at ``key``'s chunk name in ``ns_dir`` (making the shard
    directories it needs)."""
    path = ns_dir / cf.relative_name(key)
    res = as_cotenant("sh", "-c", 'mkdir -p "$1" && cat > "$2"', "sh", path.parent, path, data=data)
    assert res.returncode == 0, res.stderr


def _forged_chunk(ns_id: str, key: bytes, body: np.ndarray) -> bytes:
    """A chunk file with a valid unkeyed header: built from what the co-tenant sees on disk (the
    namespace id is the directory name, the key the file name)."""
    return cf.build_header(bytes.fromhex(ns_id), key, body) + body.tobytes()


def test_c43_a_chunk_a_group_member_plants_is_a_forged_miss_with_an_integrity_key(
    shared, monkeypatch
):
    root = group_root(shared)
    k = keys_for(1, seed=43)[0]
    evil = np.full(ROW, 0x66, dtype=np.uint8)
    # Without a key, what README says plainly: whoever can write the root serves its bytes.
    with Rig([fs_tier(root, share_with_group=True)], num_slots=4) as plain:
        ns_id = plain.fs.ns_id
        listed = as_cotenant("ls", root)
        assert listed.returncode == 0 and ns_id.encode() in listed.stdout
        _plant(root / ns_id, k, _forged_chunk(ns_id, k, evil))
        assert plain.resolve([k]) == [HIT]
        (row,) = plain.read([k])
        assert np.array_equal(row, evil)
    monkeypatch.setenv(INTEGRITY_ENV, "a key the co-tenant does not have, 0123456789")
    keyed_tier = fs_tier(root, share_with_group=True, integrity_key_env=INTEGRITY_ENV)
    with Rig([keyed_tier], num_slots=4) as keyed:
        ns_id = keyed.fs.ns_id
        own = keys_for(2, seed=44)
        keyed.store(own)
        _plant(root / ns_id, k, _forged_chunk(ns_id, k, evil))
        planted = root / ns_id / cf.relative_name(k)
        assert planted.stat().st_uid == cotenant().pw_uid
        assert keyed.resolve([k]) == [MISS]
        assert failed_chunks(keyed, "load") == {"forged": 1}
        assert keyed.fs.counters["forged_removed"] == 1
        assert not planted.exists()
        keyed.evict_all()
        assert keyed.resolve(own) == [HIT, HIT]  # its own chunks carry the MAC
        assert all(np.array_equal(r, payload(o)) for o, r in zip(own, keyed.read(own)))


def test_c43_a_shard_directory_link_a_group_member_plants_sends_nothing_outside_the_root(shared):
    """The tier runs as root, who may write anywhere: only refusing the link keeps its stores
    in the root. A link put in place of a chunk file is not read through either."""
    root = group_root(shared)
    outside = shared / "outside"
    assert as_cotenant("mkdir", "-m", "0777", outside).returncode == 0
    k, k2 = keys_for(2, seed=45)
    with Rig([fs_tier(root, share_with_group=True)], num_slots=4) as rig:
        ns_dir = root / rig.fs.ns_id
        a, _ = cf.shard_dirs(k)
        assert as_cotenant("ln", "-s", outside, ns_dir / a).returncode == 0
        rig.store([k])
        assert failed_chunks(rig, "store") == {"unsafe_path": 1}
        assert os.listdir(outside) == []
        assert not os.path.lexists(ns_dir / a)  # the link was removed, never followed
        rig.tm.host.remove([k])
        rig.store([k, k2])  # offered again: stored in the root
        assert chunk_file(root, rig, k).is_file() and os.listdir(outside) == []
        rig.evict_all()
        # A link in place of a chunk file, to a valid copy the co-tenant made outside.
        path = chunk_file(root, rig, k2)
        copy = outside / path.name
        assert as_cotenant("cp", path, copy).returncode == 0
        assert as_cotenant("ln", "-sf", copy, path).returncode == 0
        assert rig.resolve([k2]) == [MISS]
        assert failed_chunks(rig, "load") == {"unsafe_path": 1}
        assert not os.path.lexists(path) and copy.stat().st_size == cf.HEADER_BYTES + ROW
        assert rig.resolve([k]) == [HIT]


def test_c43_a_namespace_directory_a_cotenant_made_first_is_warned_of(shared, caplog):
    """On a root anyone may write (1777, made so by an operator), the co-tenant creates the
    namespace directory before the engine starts: the start says so, naming its owner."""
    ns = namespace()
    assert as_cotenant("mkdir", "-m", "0777", shared / ns.id()).returncode == 0
    with caplog.at_level(logging.WARNING, logger="kvoffload.tiers"):
        with Rig([fs_tier(shared)], num_slots=4, ns=ns) as rig:
            rig.store(keys_for(1))
    warned = [r.getMessage() for r in caplog.records if ns.id() in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert f"mode 777 and owned by uid {cotenant().pw_uid}" in warned[0]
    assert "write (forge) them" in warned[0]
