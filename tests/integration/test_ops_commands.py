"""Operator commands on real tier roots: ``kvoffload inspect`` (fs root; s3://bucket/prefix on
moto), ``kvoffload sweep --fs-root`` (orphaned temporary files, CASES C29), ``kvoffload check``.
What needs no process, socket or arena (bad input, the settings table, two writers with one PID)
is tests/unit/test_ops_commands.py, whose ``run_cli`` this file shares."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest
from helpers import HIT, ROW, TESTS_DIR, Rig, fs_tier, keys_for, namespace, payload
from s3 import ACCESS, SECRET, client, new_bucket, obj_tier, start_moto
from unit.test_ops_commands import run_cli, table_rows

from kvoffload.workers.chunkfile import HEADER_BYTES
from kvoffload.workers.fs_io import STALE_TEMP_AGE_S

FILE_BYTES = HEADER_BYTES + ROW
OLD = 2 * STALE_TEMP_AGE_S  # seconds: well past the orphan age


def chunk_files(ns_dir):
    out = []
    for d, _, names in os.walk(ns_dir):
        out.extend(os.path.join(d, n) for n in names if n.endswith(".kv"))
    return out


def plant_temp(ns_dir, name, nbytes, age_s=0.0, shard=("00", "00")):
    """A temporary file as a writer leaves it, last written ``age_s`` seconds ago."""
    path = os.path.join(ns_dir, *shard, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"t" * nbytes)
    if age_s:
        t = time.time() - age_s
        os.utime(path, (t, t))
    return path


def dead_pid() -> int:
    """A PID no process has here (what another PID namespace's writer PID looks like)."""
    pid = psutil.Process().pid + 10_000
    while psutil.pid_exists(pid):
        pid += 1
    return pid


# -- CASES C29 -------------------------------------------------------------------------------------

_INSTANCE_A = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {tests!r})
    from helpers import Rig, fs_tier, keys_for

    root, resume, out, arena, last_pid = sys.argv[1:6]
    if int(last_pid):
        # Start this PID namespace's numbering where the outer namespace has no process, so the
        # writer's PID in its temporary file's name is one that does not exist there.
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(last_pid)
    key = keys_for(1, seed=29)[0]
    pause = [{{"point": "before_publish", "action": "wait_file", "arg": resume}}]
    with Rig([fs_tier(root, faults=pause, job_timeout_s=300.0)], num_slots=4, name=arena) as a:
        a.store([key], wait=False)
        idle = a.tm.wait_idle(300)
        c = a.fs.counters
        result = {{"idle": idle, "stored": c.get("store_chunks", 0),
                   "failed": c.get("store_failures", 0), "pid": os.getpid(),
                   "stale_temp_removed": c.get("stale_temp_removed", 0)}}
    with open(out + ".part", "w") as f:
        json.dump(result, f)
    os.rename(out + ".part", out)
""")


def _unshare_pid_ns() -> list[str] | None:
    """``unshare`` arguments that run a command in a new PID namespace here, or None."""
    exe = shutil.which("unshare")
    if exe is None or os.geteuid() != 0:
        return None
    cmd = [exe, "--pid", "--fork", "--mount-proc"]
    probe = subprocess.run(
        cmd + ["sh", "-c", "echo $$"], capture_output=True, text=True, timeout=30, check=False
    )
    if probe.returncode != 0 or probe.stdout.strip() != "1":
        return None
    return cmd


def _free_pid_window(width: int = 300) -> int:
    """A PID below which ``width`` consecutive PIDs are unused here, as far behind this namespace's
    PID allocation cursor as can be (the last PIDs it hands out again)."""
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    with open("/proc/sys/kernel/ns_last_pid") as f:
        cursor = int(f.read())
    used = set(psutil.pids())
    behind = list(range(cursor - width - 1000, 300, -width))
    wrapped = list(range(pid_max - width - 2, cursor + 1000, -width))
    for base in behind + wrapped:
        if not used.intersection(range(base + 1, base + width + 1)):
            return base
    raise AssertionError("no free PID window")


def test_c29_instance_starting_on_a_shared_root_keeps_another_namespaces_file_in_progress(tmp_path):
    """C29: instance A (its workers in their own PID namespace) is paused between writing a chunk's
    temporary file and renaming it; instance B starts on the same root; A resumes. A's store
    succeeds, B reads the chunk, and a real orphan (old) is removed while a fresh one is kept."""
    unshare = _unshare_pid_ns()
    if unshare is None:
        pytest.skip("needs root and unshare --pid (a PID namespace) for instance A")
    root = tmp_path / "root"
    root.mkdir()
    resume, out = tmp_path / "resume", tmp_path / "a.json"
    ns_dir = os.path.join(root, namespace().id())
    old_orphan = plant_temp(ns_dir, f".{'ab' * 20}.{dead_pid()}.0.tmp", 777, age_s=OLD)
    young_orphan = plant_temp(ns_dir, f".{'cd' * 20}.{dead_pid()}.0.tmp", 555)
    key = keys_for(1, seed=29)[0]
    script = _INSTANCE_A.format(tests=TESTS_DIR)
    a = subprocess.Popen(
        unshare
        + [
            sys.executable,
            "-c",
            script,
            str(root),
            str(resume),
            str(out),
            f"kvoffload_test_c29_{os.getpid()}",
            str(_free_pid_window()),
        ]
    )
    try:
        # A's writer has written its temporary file and waits before the rename.
        prefix = f".{key.hex()}."
        deadline = time.monotonic() + 120
        a_tmp = None
        while a_tmp is None:
            assert a.poll() is None, "instance A exited early"
            assert time.monotonic() < deadline, "instance A never wrote its temporary file"
            for d, _, names in os.walk(ns_dir):
                a_tmp = next((os.path.join(d, n) for n in names if n.startswith(prefix)), a_tmp)
            time.sleep(0.05)
        writer_pid = int(os.path.basename(a_tmp).split(".")[2].split("-")[0])
        assert not psutil.pid_exists(writer_pid), "A's writer PID exists here: not the C29 setup"
        with Rig([fs_tier(root)], num_slots=4) as b:
            assert b.tm.wait_idle(60)  # B's start-up scan of the root is done
            resume.touch()
            a.wait(timeout=300)
            result = json.loads(out.read_text())
            assert result["pid"] == 1  # A ran in its own PID namespace
            assert (result["idle"], result["stored"], result["failed"]) == (True, 1, 0)
            assert b.resolve([key]) == [HIT]
            assert np.array_equal(b.read([key])[0], payload(key))
            # The old orphan went at A's start or at B's (both scan the namespace), exactly once.
            assert result["stale_temp_removed"] + b.fs.counters.get("stale_temp_removed", 0) == 1
        assert not os.path.exists(old_orphan)
        assert os.path.exists(young_orphan)  # its writer may be alive elsewhere: only age decides
    finally:
        resume.touch()
        if a.poll() is None:
            a.kill()
            a.wait()


def test_c29_a_fresh_temp_file_of_a_pid_unknown_here_survives_start_and_goes_once_old(tmp_path):
    """The same rule without PID namespaces: at start a tier removes temporary files by age only."""
    with Rig([fs_tier(tmp_path)], num_slots=4) as run1:
        run1.store(keys_for(2))
        ns_dir = os.path.join(tmp_path, run1.ns.id())
    fresh = plant_temp(ns_dir, f".{'ef' * 20}.{dead_pid()}.3.tmp", 100)
    old = plant_temp(ns_dir, f".{'01' * 20}.{dead_pid()}.4.tmp", 100, age_s=OLD)
    old_config_tmp = plant_temp(ns_dir, f"config.json.{dead_pid()}.tmp", 10, age_s=OLD, shard=())
    with Rig([fs_tier(tmp_path)], num_slots=4) as run2:
        assert run2.tm.wait_idle(60)
        assert run2.fs.counters.get("stale_temp_removed") == 2
    assert os.path.exists(fresh)
    assert not os.path.exists(old) and not os.path.exists(old_config_tmp)
    assert len(chunk_files(ns_dir)) == 2


# -- kvoffload inspect (fs) -----------------------------------------------------------------------


def _two_namespace_root(root):
    """A root with namespace A (5 chunks, salt "a") and namespace B (3 chunks, 8 tokens per chunk);
    returns their namespaces."""
    ns_a = namespace(cache_salt="a")
    ns_b = namespace(tokens_per_chunk=8, model="other/model", revision="r1")
    with Rig([fs_tier(root)], num_slots=8, ns=ns_a) as a:
        a.store(keys_for(5))
    with Rig([fs_tier(root)], num_slots=8, ns=ns_b) as b:
        b.store(keys_for(3, seed=7))
    return ns_a, ns_b


def test_inspect_fs_root_reports_identity_chunks_bytes_use_times_and_temp_files(tmp_path):
    ns_a, ns_b = _two_namespace_root(tmp_path)
    dir_a = os.path.join(tmp_path, ns_a.id())
    young = plant_temp(dir_a, f".{'aa' * 20}.{dead_pid()}.0.tmp", 300)
    old = plant_temp(dir_a, f".{'bb' * 20}.{dead_pid()}.0.tmp", 200, age_s=OLD, shard=("01", "02"))
    res = run_cli("inspect", str(tmp_path), "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["kind"] == "fs" and report["root"] == str(tmp_path)
    by_id = {ns["id"]: ns for ns in report["namespaces"]}
    assert set(by_id) == {ns_a.id(), ns_b.id()}
    for ns, n in ((ns_a, 5), (ns_b, 3)):
        got = by_id[ns.id()]
        assert got["identity"] == json.loads(ns.to_json())
        assert got["problem"] is None
        assert got["chunks"] == n and got["bytes"] == n * FILE_BYTES
        mtimes = [os.stat(f).st_mtime for f in chunk_files(os.path.join(tmp_path, ns.id()))]
        assert got["oldest_use"] == pytest.approx(min(mtimes), abs=1e-6)
        assert got["newest_use"] == pytest.approx(max(mtimes), abs=1e-6)
        assert got["other_files"] == 0
    temp_a = by_id[ns_a.id()]["temp"]
    assert temp_a["count"] == 2 and temp_a["bytes"] == 500 and temp_a["stale"] == 1
    assert temp_a["oldest"] == pytest.approx(os.stat(old).st_mtime, abs=1e-6)
    assert by_id[ns_b.id()]["temp"] == {"count": 0, "bytes": 0, "oldest": None, "stale": 0}
    assert os.path.exists(young) and os.path.exists(old)  # inspecting removes nothing

    table = run_cli("inspect", str(tmp_path))
    assert table.exit_code == 0, table.output
    text = table.output
    for expected in (
        f"namespace {ns_a.id()}",
        f"namespace {ns_b.id()}",
        "other/model",
        "r1",
        "raw-v1",
        "bfloat16",
        str(ROW),
        "1 stale",
        "total: 8 chunks",
    ):
        assert expected in text, (expected, text)


def test_inspect_reads_no_chunk_payload(tmp_path):
    """Scanning stats chunk files and reads config.json only: no chunk's access time moves."""
    _two_namespace_root(tmp_path)
    files = chunk_files(tmp_path)
    long_ago = time.time() - 3 * 86400
    for f in files:
        os.utime(f, (long_ago, long_ago))
    with open(files[0], "rb") as fh:  # control: this filesystem records reads in atime
        fh.read(1)
    if os.stat(files[0]).st_atime == long_ago:
        pytest.skip(f"{tmp_path} does not update access times (noatime)")
    os.utime(files[0], (long_ago, long_ago))
    res = run_cli("inspect", str(tmp_path), "--json")
    assert res.exit_code == 0, res.output
    assert [os.stat(f).st_atime for f in files] == [long_ago] * len(files)


def test_inspect_flags_a_namespace_whose_config_does_not_match_its_directory(tmp_path):
    ns_a, ns_b = _two_namespace_root(tmp_path)
    shutil.copy(
        os.path.join(tmp_path, ns_b.id(), "config.json"),
        os.path.join(tmp_path, ns_a.id(), "config.json"),
    )
    os.remove(os.path.join(tmp_path, ns_b.id(), "config.json"))
    report = json.loads(run_cli("inspect", str(tmp_path), "--json").output)
    by_id = {ns["id"]: ns for ns in report["namespaces"]}
    assert "not to its directory name" in by_id[ns_a.id()]["problem"]
    assert "no config.json" in by_id[ns_b.id()]["problem"]
    assert by_id[ns_b.id()]["chunks"] == 3


def test_inspect_bad_targets_exit_2_with_a_message(tmp_path):
    ns_a, _ = _two_namespace_root(tmp_path / "root")
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    cases = {
        str(tmp_path / "missing"): "no such directory",
        str(tmp_path / "file"): "not a directory",
        str(tmp_path / "empty"): "not an fs tier root",
        str(tmp_path / "root" / ns_a.id()): "namespace directory, not a tier root",
        "s3://": "no bucket name",
    }
    for target, message in cases.items():
        res = run_cli("inspect", target)
        assert res.exit_code == 2, (target, res.output)
        assert message in res.output, (target, res.output)


# -- kvoffload inspect (obj) ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def moto():
    srv, endpoint = start_moto()
    yield endpoint
    srv.stop()


S3_ENV = {
    "AWS_ACCESS_KEY_ID": ACCESS,
    "AWS_SECRET_ACCESS_KEY": SECRET,
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_ENDPOINT_URL": None,
    "AWS_PROFILE": None,
}


def test_inspect_s3_prefix_reports_namespaces_from_the_listing(moto):
    bucket = new_bucket(moto)
    ns_a = namespace(cache_salt="a")
    ns_b = namespace(kv_dtype="float16")
    with Rig([obj_tier(moto, bucket, prefix="team-a")], num_slots=8, ns=ns_a) as a:
        a.store(keys_for(4))
    with Rig([obj_tier(moto, bucket, prefix="team-a")], num_slots=8, ns=ns_b) as b:
        b.store(keys_for(2, seed=3))
    with Rig([obj_tier(moto, bucket, prefix="team-b")], num_slots=8, ns=ns_a) as c:
        c.store(keys_for(1, seed=5))
    res = run_cli("inspect", f"s3://{bucket}/team-a", "--endpoint-url", moto, "--json", env=S3_ENV)
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["kind"] == "obj" and report["stale_temp_age_s"] is None
    by_id = {ns["id"]: ns for ns in report["namespaces"]}
    assert set(by_id) == {ns_a.id(), ns_b.id()}
    s3 = client(moto)
    for ns, n in ((ns_a, 4), (ns_b, 2)):
        got = by_id[ns.id()]
        assert got["identity"] == json.loads(ns.to_json()) and got["problem"] is None
        assert got["chunks"] == n and got["bytes"] == n * FILE_BYTES
        assert got["temp"] is None
        listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"team-a/{ns.id()}/")["Contents"]
        times = [o["LastModified"].timestamp() for o in listed if o["Key"].endswith(".kv")]
        assert got["oldest_use"] == min(times) and got["newest_use"] == max(times)
        assert got["location"] == f"s3://{bucket}/team-a/{ns.id()}/"
    # The endpoint from the environment (boto3's chain) instead of the option; a table this time.
    res = run_cli("inspect", f"s3://{bucket}/team-b", env={**S3_ENV, "AWS_ENDPOINT_URL": moto})
    assert res.exit_code == 0, res.output
    assert f"namespace {ns_a.id()}" in res.output and "total: 1 chunks" in res.output


def test_inspect_s3_bad_targets_exit_2_with_a_message(moto):
    bucket = new_bucket(moto)
    with Rig([obj_tier(moto, bucket, prefix="p")], num_slots=4) as rig:
        rig.store(keys_for(1))
    from s3 import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    cases = [
        (f"s3://{bucket}", moto, "not an obj tier root"),  # the namespaces are under p/
        (f"s3://{bucket}/elsewhere", moto, "not an obj tier root"),
        ("s3://no-such-bucket-kvoffload/p", moto, "does not exist"),
        (f"s3://{bucket}/p", dead, "cannot reach"),
    ]
    for target, endpoint, message in cases:
        res = run_cli("inspect", target, "--endpoint-url", endpoint, env=S3_ENV)
        assert res.exit_code == 2, (target, res.output)
        assert message in res.output, (target, res.output)
    res = run_cli("inspect", f"s3://{bucket}/p", "--endpoint-url", moto, "--json", env=S3_ENV)
    assert res.exit_code == 0 and json.loads(res.output)["namespaces"][0]["chunks"] == 1


# -- kvoffload sweep --fs-root --------------------------------------------------------------------


def test_sweep_fs_root_removes_old_temp_files_only_and_lists_without_removing(tmp_path):
    ns_a, ns_b = _two_namespace_root(tmp_path)
    dir_a, dir_b = (os.path.join(tmp_path, ns.id()) for ns in (ns_a, ns_b))
    old = [
        plant_temp(dir_a, f".{'aa' * 20}.{dead_pid()}.0.tmp", 100, age_s=OLD),
        plant_temp(dir_b, f".{'bb' * 20}.{dead_pid()}.1.tmp", 50, age_s=OLD, shard=("ff", "0e")),
        plant_temp(dir_b, f".write-test.{dead_pid()}.tmp", 0, age_s=OLD, shard=()),
    ]
    middle = plant_temp(dir_a, f".{'cc' * 20}.{dead_pid()}.0.tmp", 100, age_s=600)
    young = plant_temp(dir_a, f".{'dd' * 20}.{dead_pid()}.0.tmp", 100)
    chunks = chunk_files(tmp_path)
    for f in chunks:  # chunks are never swept, however old
        os.utime(f, (time.time() - OLD, time.time() - OLD))

    listing = run_cli("sweep", "--list", "--fs-root", str(tmp_path))
    assert listing.exit_code == 0, listing.output
    assert all(os.path.exists(p) for p in old + [middle, young])
    assert "3 orphaned temp file(s)" in listing.output and "2 younger kept" in listing.output
    assert all(os.path.basename(p) in listing.output for p in old)

    res = run_cli("sweep", "--fs-root", str(tmp_path))
    assert res.exit_code == 0, res.output
    assert "removed 3 orphaned temp file(s)" in res.output
    assert not any(os.path.exists(p) for p in old)
    assert os.path.exists(middle) and os.path.exists(young)

    res = run_cli("sweep", "--fs-root", str(tmp_path), "--older-than", "300")
    assert res.exit_code == 0, res.output
    assert not os.path.exists(middle) and os.path.exists(young)
    assert sorted(chunk_files(tmp_path)) == sorted(chunks)
    assert all(os.path.exists(os.path.join(d, "config.json")) for d in (dir_a, dir_b))
    # The namespaces still serve their chunks.
    with Rig([fs_tier(tmp_path)], num_slots=8, ns=ns_a) as rig:
        keys = keys_for(5)
        assert rig.resolve(keys) == [HIT] * 5
        assert all(np.array_equal(r, payload(k)) for k, r in zip(keys, rig.read(keys)))


# -- kvoffload check ------------------------------------------------------------------------------


def test_check_warns_of_an_fs_tier_on_a_disk_already_past_its_floor(tmp_path):
    """A config can be valid and still make a tier that stores nothing: its disk already has less
    free than ``min_free_fraction``. ``check`` says so (exit 0: the config is valid); a tier with
    no floor, or room above it, gets no warning."""
    from kvoffload.tools.stress_faults import FaultError, small_tmpfs

    try:
        mount = small_tmpfs(1 << 20)
        mnt = mount.__enter__()
    except FaultError as e:
        pytest.skip(f"needs a small tmpfs of its own (root, mount permitted): {e}")
    try:
        with open(os.path.join(mnt, "filler"), "wb") as f:
            f.write(b"\0" * (1000 << 10))  # ~2 % free: under the default 5 % floor
        path = tmp_path / "extra.json"
        for tier, warned in (
            ({"type": "fs", "root_dir": os.path.join(mnt, "kv")}, True),
            ({"type": "fs", "root_dir": os.path.join(mnt, "kv"), "min_free_fraction": 0}, False),
            ({"type": "fs", "root_dir": str(tmp_path / "kv"), "min_free_fraction": 0}, False),
        ):
            path.write_text(json.dumps({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier]}))
            res = run_cli("check", str(path))
            assert res.exit_code == 0, res.output
            assert ("below its free-space floor" in res.output) == warned, res.output
    finally:
        mount.__exit__(None, None, None)


def test_check_shows_the_settings_the_tiers_start_with(tmp_path, moto):
    """The values ``kvoffload check`` prints for settings left to their defaults or derived from
    other keys (locality, workers from io_workers, I/O threads in total) are the ones real fs and
    obj tiers start with from the same configuration."""
    from kvoffload.ipc.channels import LOADS, STORES

    tiers = [
        fs_tier(tmp_path / "kv", io_threads=3, n_write_threads=5),
        obj_tier(moto, new_bucket(moto), io_workers=3),
    ]
    raw = {"cpu_bytes_to_use": 8 * ROW, "secondary_tiers": tiers}
    path = tmp_path / "extra.json"
    path.write_text(json.dumps(raw))
    res = run_cli("check", str(path))
    assert res.exit_code == 0, res.output
    rows = table_rows(res.output)
    with Rig(tiers, num_slots=8) as rig:
        for i, tier in enumerate(rig.tm.tiers):
            key = f"secondary_tiers[{i}]."
            assert rows[key + "locality"][0] == tier.locality
            c = tier.config
            assert rows[key + "read_workers"][0] == str(c.read_workers)
            assert rows[key + "write_workers"][0] == str(c.write_workers)
            for side, kind, workers in (
                ("read", LOADS, c.read_workers),
                ("write", STORES, c.write_workers),
            ):
                total = int(rows[f"{key}{side}_io_threads"][0])
                assert tier._io_threads(kind) == -(-total // workers)  # threads per worker
            assert rows[key + "chunks_per_task"][0].startswith("auto:")
            assert tier.chunks_per_task >= 1  # decided from the chunk size at start
    fs, obj = "secondary_tiers[0].", "secondary_tiers[1]."
    assert rows[fs + "locality"] == ("LOCAL", "default")
    assert rows[fs + "read_io_threads"] == ("3", "set")  # 1 reader x io_threads 3, both set
    assert rows[fs + "write_io_threads"] == ("5", "set")
    assert rows[obj + "locality"] == ("REMOTE", "default")
    assert rows[obj + "read_workers"] == ("3", "set")  # from io_workers
    assert rows[obj + "read_io_threads"] == ("12", "set")  # 3 workers x io_threads 4
