"""``kvoffload doctor`` against real parts: configuration files compared, a real p2p instance
(``tests/p2p_instance.py``, its own process) probed with the tier's own client, an fs root on a
read-only tmpfs, a real KV-event publisher with its replay socket, a real metrics endpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading

import msgspec
import pytest
from click.testing import CliRunner
from p2p_instance import namespace

from integration.test_p2p_tier import ROW, p2p, world  # noqa: F401 (world: a fixture)
from kvoffload.config import KVEventsConfig
from kvoffload.events import AllBlocksCleared, EventPublisher
from kvoffload.tools.cli import main
from kvoffload.tools.ports import free_port

SPEC = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.vllm"}


def config(**extra) -> dict:
    return {**SPEC, "cpu_bytes_to_use": 1 << 20, **extra}


def doctor(tmp_path, configs: list[dict], *args: str, env: dict | None = None):
    """``kvoffload doctor --json FILE... ARGS``: the exit status and the findings."""
    paths = []
    for i, c in enumerate(configs):
        path = tmp_path / f"instance{i}.json"
        path.write_text(json.dumps(c))
        paths.append(str(path))
    result = CliRunner().invoke(main, ["doctor", "--json", *paths, *args], env=env or {})
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.output)["findings"]


def findings(found: list[dict], check: str) -> list[dict]:
    return [f for f in found if f["check"] == check]


def one(found: list[dict], check: str) -> dict:
    (f,) = findings(found, check)
    return f


def test_two_instances_differing_in_chunk_size_salt_and_hash_seed_are_named_and_exit_1(tmp_path):
    root = str(tmp_path / "root")
    fs = [{"type": "fs", "root_dir": root}]
    a = config(blocks_per_chunk=4, cache_salt="tenant-a", secondary_tiers=fs)
    b = config(blocks_per_chunk=8, secondary_tiers=fs)
    status, found = doctor(
        tmp_path, [a, b], "--hash-seed", "0", "--hash-seed", "unset", "--same-host"
    )
    assert status == 1
    assert "tenant-a" not in json.dumps(found)  # a salt is never printed, only set or empty
    for field, a_says, b_says in (
        ("cache_salt", ": set", ": empty"),
        ("chunk size", "blocks_per_chunk 4", "blocks_per_chunk 8"),
        ("hash seed", "PYTHONHASHSEED=0", "vLLM's default (sha256 without PYTHONHASHSEED)"),
    ):
        f = one(found, f"namespace: {field}")
        assert f["status"] == "fail", f
        assert a_says in f["found"] and b_says in f["found"], f
        assert f["fix"], f
    assert one(found, "namespace: layout")["status"] == "ok"
    assert one(found, "shared fs root")["status"] == "ok"  # one root, two namespaces: rows above


def test_block_size_and_blocks_per_chunk_are_compared_in_tokens_with_the_engines_block_size(
    tmp_path,
):
    a, b = config(block_size=64), config(blocks_per_chunk=4)
    status, found = doctor(tmp_path, [a, b])
    assert one(found, "namespace: chunk size")["status"] == "warn"  # not comparable as given
    status, found = doctor(tmp_path, [a, b], "--block-size", "16")
    assert status == 0
    assert one(found, "namespace: chunk size")["status"] == "ok"
    status, found = doctor(tmp_path, [a, b], "--block-size", "32")
    assert status == 1
    assert "128 tokens" in one(found, "namespace: chunk size")["found"]


def test_two_matching_instances_exit_0(tmp_path):
    root = str(tmp_path / "root")
    c = config(
        blocks_per_chunk=4, cache_salt="team", secondary_tiers=[{"type": "fs", "root_dir": root}]
    )
    status, found = doctor(tmp_path, [c, c], "--hash-seed", "7", "--hash-seed", "7", "--same-host")
    assert status == 0, found
    assert not [f for f in found if f["status"] == "fail"]
    assert one(found, "namespace: hash seed")["status"] == "ok"
    assert one(found, "shared fs root")["status"] == "ok"


def test_xxhash_without_a_hash_seed_fails_with_a_shared_tier(tmp_path):
    c = config(secondary_tiers=[{"type": "fs", "root_dir": str(tmp_path / "root")}])
    status, found = doctor(tmp_path, [c], "--hash-seed", "unset", "--hash-algo", "xxhash")
    assert status == 1
    assert "random per process" in one(found, "namespace: hash seed")["found"]


def test_bad_usage_exits_2(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps(config()))
    for args in (
        [str(tmp_path / "missing.json")],
        [str(path), "--hash-seed", "1", "--hash-seed", "2"],
        [str(path), "--hash-algo", "md5"],
    ):
        result = CliRunner().invoke(main, ["doctor", *args], env={})
        assert result.exit_code == 2, (args, result.output)
    (tmp_path / "b.json").write_text("{not json")
    assert CliRunner().invoke(main, ["doctor", str(tmp_path / "b.json")]).exit_code == 2


def test_an_fs_root_that_is_not_writable_fails_and_a_tmpfs_root_is_named(tmp_path):
    from kvoffload.tools.stress_faults import FaultError, small_tmpfs

    if os.geteuid() != 0:  # chmod stops this user (root may write any directory)
        root = tmp_path / "ro"
        root.mkdir()
        root.chmod(0o555)
        try:
            status, found = doctor(
                tmp_path, [config(secondary_tiers=[{"type": "fs", "root_dir": str(root)}])]
            )
        finally:
            root.chmod(0o755)
        assert status == 1
        (f,) = [f for f in found if f["status"] == "fail"]
        assert "not writable" in f["found"], f
        return
    try:
        mount = small_tmpfs(1 << 20)
        mnt = mount.__enter__()
    except FaultError as e:
        pytest.skip(f"needs a small tmpfs of its own (root, mount permitted): {e}")
    try:
        r = subprocess.run(["mount", "-o", "remount,ro", mnt], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot remount a tmpfs read-only here: {r.stderr.strip()}")
        tier = {"type": "fs", "root_dir": mnt}
        status, found = doctor(tmp_path, [config(secondary_tiers=[tier])])
    finally:
        mount.__exit__(None, None, None)
    assert status == 1
    (f,) = [f for f in found if f["status"] == "fail"]
    assert f["check"] == "config: root_dir usable" and "read-only filesystem" in f["found"], f
    storage = one(found, "fs root storage")
    assert storage["status"] == "warn" and "tmpfs" in storage["found"], storage


def test_a_p2p_peer_with_another_secret_is_named_as_an_auth_failure(world, tmp_path):  # noqa: F811
    """A real serving instance (its own process, the tests' secret) probed with the tier's own
    client: another secret is an auth failure; the same secret authenticates, and the Hello's
    namespace is compared when the doctor is given it."""
    a = world.instance(p2p("tcp", free_port()))
    ns_id = namespace(row_bytes=ROW).id()
    other = "another-secret-" + "x" * 32
    wrong = config(secondary_tiers=[dict(p2p("tcp", free_port(), [a.addr]), secret=other)])
    status, found = doctor(tmp_path, [wrong], "--namespace-id", ns_id)
    assert status == 1
    f = one(found, "p2p peer")
    assert f["status"] == "fail" and "auth failure" in f["found"], f
    assert "secret" in f["fix"], f

    right = config(secondary_tiers=[p2p("tcp", free_port(), [a.addr])])
    status, found = doctor(tmp_path, [right], "--namespace-id", ns_id)
    f = one(found, "p2p peer")
    assert f["status"] == "ok" and "authenticated" in f["found"], f
    assert status == 0, found
    skew = one(found, "clock skew")  # nothing measured it: said, not passed
    assert skew["status"] == "warn" and "carries no time" in skew["found"], skew
    refused = a.ok("counters")["refused_messages"]
    assert not any(refused.values()), refused  # the probe's session broke no rule of the server

    status, found = doctor(tmp_path, [right], "--namespace-id", "0" * 32)
    f = one(found, "p2p peer")
    assert status == 1 and "another namespace" in f["found"], f

    status, found = doctor(tmp_path, [right])  # no namespace id: the secret only
    f = one(found, "p2p peer")
    assert f["status"] == "ok" and "secret is the same" in f["found"], f

    gone = config(secondary_tiers=[p2p("tcp", free_port(), [f"127.0.0.1:{free_port()}"])])
    status, found = doctor(tmp_path, [gone], "--namespace-id", ns_id)
    f = one(found, "p2p peer")
    assert status == 1 and f["found"].startswith("unreachable"), f


def test_kv_events_replay_and_subscriber_see_the_expected_topic_or_name_the_publishers(tmp_path):
    port, replay_port = free_port(), free_port()
    ev = KVEventsConfig(
        endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}"
    )
    pub = EventPublisher(ev)
    try:
        assert pub.flush()
        events = {"endpoint": ev.endpoint, "replay_endpoint": ev.replay_endpoint}
        status, found = doctor(tmp_path, [config(kv_events=events)], "--events-wait", "0.2")
        assert status == 0, found
        f = one(found, "KV events replay")
        assert f["status"] == "ok" and "'kv-events'" in f["found"], f
        idle = one(found, "KV events")  # idle: no batch, the topic confirmed by the replay
        assert idle["status"] == "warn" and "replay row" in idle["found"], idle

        # batches published while the doctor subscribes: it sees the topic and their clock
        stop = threading.Event()

        def publish():
            while not stop.wait(0.05):
                pub.publish([AllBlocksCleared()], [])

        thread = threading.Thread(target=publish)
        thread.start()
        try:
            status, found = doctor(tmp_path, [config(kv_events=events)], "--events-wait", "60")
        finally:
            stop.set()
            thread.join()
        assert status == 0, found
        f = one(found, "KV events")
        assert f["status"] == "ok" and "receives batches" in f["found"], f
        assert one(found, "clock skew")["status"] == "ok"

        other = {**events, "topic": "other-topic"}
        status, found = doctor(tmp_path, [config(kv_events=other)], "--events-wait", "0.2")
        assert status == 1
        f = one(found, "KV events replay")
        assert f["status"] == "fail" and "'other-topic'" in f["found"], f
        assert "kv-events" in f["found"], f  # the publisher's own topic, named
    finally:
        pub.close()
    status, found = doctor(tmp_path, [config(kv_events=events)], "--events-wait", "0.2")
    assert status == 1
    assert "nothing listens" in one(found, "KV events")["found"]


def test_a_metrics_endpoint_answers_and_its_clock_is_compared(tmp_path):
    from kvoffload import metrics

    port = metrics.serve(0)
    try:
        status, found = doctor(tmp_path, [config()], "--metrics", f"127.0.0.1:{port}")
    finally:
        metrics.stop_serving()
    assert one(found, "metrics")["status"] in ("ok", "warn")  # no manager in this process
    skew = one(found, "clock skew")
    assert skew["status"] == "ok" and "from ours" in skew["found"], skew
    assert status == 0


def test_the_namespaces_a_shared_root_holds_are_compared_field_by_field(tmp_path):
    from kvoffload.namespace import Namespace

    root = tmp_path / "root"
    for salt, tokens in (("", 16), ("tenant-b", 32)):
        ns = Namespace(
            model="m", kv_dtype="bfloat16", layout="raw-v1", tokens_per_chunk=tokens,
            row_bytes=4096, cache_salt=salt,
        )  # fmt: skip
        (root / ns.id()).mkdir(parents=True)
        (root / ns.id() / "config.json").write_bytes(ns.to_json())
    c = config(secondary_tiers=[{"type": "fs", "root_dir": str(root)}])
    status, found = doctor(tmp_path, [c])
    f = one(found, "namespaces in root")
    assert f["status"] == "warn", f
    assert "differ in tokens_per_chunk, cache_salt" in f["found"], f
    assert "tenant-b" not in json.dumps(found) and "cache_salt=set" in f["found"], f
    assert status == 0


def test_the_table_names_each_mismatch_and_its_fix(tmp_path):
    paths = []
    for i, salt in enumerate(("a", "b")):
        path = tmp_path / f"i{i}.json"
        path.write_text(json.dumps(config(cache_salt=salt)))
        paths.append(str(path))
    result = CliRunner().invoke(main, ["doctor", *paths], env={})
    assert result.exit_code == 1, result.output
    (line,) = [ln for ln in result.output.splitlines() if "namespace: cache_salt" in ln]
    assert "fail" in line and "different values" in line and "set the same cache_salt" in line


def test_p2p_tiers_that_do_not_name_each_other_or_differ_in_auth_are_named(tmp_path):
    pa, pb = free_port(), free_port()
    a = {"type": "p2p", "host": "127.0.0.1", "port": pa, "peers": [f"127.0.0.1:{pb}"]}
    b = {"type": "p2p", "host": "127.0.0.1", "port": pb, "auth": "none"}
    b["trust_local_users"] = True
    status, found = doctor(
        tmp_path,
        [config(secondary_tiers=[a]), config(secondary_tiers=[b])],
        "--timeout",
        "0.5",
        env={"KVOFFLOAD_P2P_SECRET": "s" * 40},
    )
    assert status == 1
    named = {f["subject"]: f for f in findings(found, "p2p peers named")}
    a_file, b_file = (str(tmp_path / f"instance{i}.json") for i in (0, 1))
    assert named[f"{a_file} -> {b_file}"]["status"] == "ok"
    b_to_a = named[f"{b_file} -> {a_file}"]
    assert b_to_a["status"] == "warn" and f"127.0.0.1:{pa}" in b_to_a["fix"], b_to_a
    auth = one(found, "p2p auth")
    assert auth["status"] == "fail" and "none" in auth["found"], auth


def test_vllm_serve_configurations_add_the_model_dtype_block_size_and_hash_algorithm(tmp_path):
    """``vllm serve --config FILE.yaml`` files: their model, dtype and block size are compared,
    the chunk size in tokens from each engine's own block size."""
    transfer = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": config(block_size=64),
    }
    a = tmp_path / "a.yaml"
    a.write_text(
        "model: org/model-a\ndtype: bfloat16\nblock-size: 16\n"
        f"kv-transfer-config: {json.dumps(transfer)}\n"
    )
    other = {**transfer, "kv_connector_extra_config": config(blocks_per_chunk=4)}
    b = tmp_path / "b.yaml"
    b.write_text(
        "model: org/model-b\nkv_cache_dtype: fp8\nblock_size: 16\n"
        f"prefix_caching_hash_algo: xxhash\nkv_transfer_config: '{json.dumps(other)}'\n"
    )
    result = CliRunner().invoke(main, ["doctor", "--json", str(a), str(b)], env={})
    assert result.exit_code == 1, result.output
    found = json.loads(result.output)["findings"]
    model = one(found, "namespace: model")
    assert model["status"] == "fail" and "org/model-a" in model["found"], model
    dtype = one(found, "namespace: kv dtype")
    assert dtype["status"] == "fail" and "bfloat16" in dtype["found"] and "fp8" in dtype["found"]
    assert one(found, "namespace: chunk size")["status"] == "ok"  # 64 tokens both
    assert one(found, "namespace: parallel geometry")["status"] == "ok"  # TP 1 x PP 1 both
    seed = one(found, "namespace: hash seed")  # sha256 vs xxhash, seeds not given
    assert "xxhash" in seed["found"], seed

    (tmp_path / "c.yaml").write_text("model: m\n")
    result = CliRunner().invoke(main, ["doctor", str(tmp_path / "c.yaml")], env={})
    assert result.exit_code == 2 and "no kv-transfer-config" in result.output


def test_instances_of_one_host_are_counted_together_against_dev_shm(tmp_path):
    st = os.statvfs("/dev/shm")
    each = (st.f_blocks * st.f_frsize * 6 // 10) // 4096 * 4096  # one fits, two do not
    c = config(cpu_bytes_to_use=each)
    status, found = doctor(tmp_path, [c, c], "--same-host")
    assert status == 1
    f = one(found, "host arenas together")
    assert f["status"] == "fail" and "2 host arenas need" in f["found"], f
    for row in findings(found, "config: host tier fits /dev/shm"):  # each alone is no failure
        assert row["status"] in ("ok", "warn"), row
    status, found = doctor(tmp_path, [config(), config()], "--same-host")
    assert one(found, "host arenas together")["status"] == "ok"


# -- review fixes: each test below failed before its fix -------------------------------------------

LIMIT_S = 120  # a generous upper bound on one doctor run that must end (it hung before)


def doctor_process(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``kvoffload doctor ARGS`` in its own process, ended after :data:`LIMIT_S` (a hang is a
    failure, not a stuck test)."""
    return subprocess.run(
        [sys.executable, "-m", "kvoffload.tools.cli", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
        env={**os.environ, **(env or {})},
    )


def test_files_that_are_no_regular_small_file_or_hold_yaml_aliases_exit_2(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate((1 << 20) + 1)
    laughs = tmp_path / "laughs.yaml"
    rows = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for i in range(1, 9):
        prev, name = chr(ord("a") + i - 1), chr(ord("a") + i)
        rows.append(f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]")
    rows.append("kv-transfer-config: {kv_connector_extra_config: {x: *i}}")
    laughs.write_text("\n".join(rows) + "\n")
    for path, says in (
        (fifo, "not a regular file"),
        ("/dev/zero", "not a regular file"),
        (big, "larger than 1 MiB"),
        (laughs, "an alias"),
    ):
        r = doctor_process(str(path))
        assert r.returncode == 2 and says in r.stderr, (path, r.stderr)


def test_malformed_endpoints_and_timeouts_exit_2(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps(config()))
    for args in (
        ["--events", f"127.0.0.1:{free_port()}"],  # no transport: ZMQ refused it, then hung
        ["--events", f"tcp://*:{free_port()}"],
        ["--events", "udp://127.0.0.1:9"],
        ["--timeout", "nan"],
        ["--timeout", "inf"],
        ["--timeout", "1e300"],
        ["--events-wait", "nan"],
        ["--metrics", "file:///etc/hostname"],
    ):
        r = doctor_process(str(path), *args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)


def test_a_replay_socket_that_never_stops_answering_is_read_within_the_timeout(tmp_path):
    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def answer_forever():
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not stop.is_set():
            if not poller.poll(50):
                continue
            ident = router.recv_multipart()[0]
            seq = 0
            while not stop.is_set():
                try:
                    router.send_multipart(
                        [ident, b"", b"kv-events", seq.to_bytes(8, "big"), b"x"], zmq.NOBLOCK
                    )
                    seq += 1
                except zmq.Again:
                    stop.wait(0.001)
                if router.poll(0):
                    break

    thread = threading.Thread(target=answer_forever)
    thread.start()
    try:
        events = {
            "endpoint": f"tcp://127.0.0.1:{port}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        }
        path = tmp_path / "a.json"
        path.write_text(json.dumps(config(kv_events=events)))
        r = doctor_process("--json", str(path), "--timeout", "1", "--events-wait", "0.1")
    finally:
        stop.set()
        thread.join()
        router.close(linger=0)
        pub.close(linger=0)
        ctx.term()
    found = json.loads(r.stdout)["findings"]
    f = one(found, "KV events replay")
    assert f["status"] == "ok" and "'kv-events'" in f["found"], f


class _Metrics:
    """A real HTTP server on loopback: ``/trickle`` sends lines without end (none a kvoffload
    metric), ``/baddate`` a Date header that is no date, anything else 404."""

    def __init__(self):
        import http.server

        stop = self.stop = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def date_time_string(self, timestamp=None):
                return (
                    "Tue, 99 Foo 20x6 99:99:99 GMT"
                    if self.path == "/baddate"
                    else (super().date_time_string(timestamp))
                )

            def do_GET(self):
                if self.path not in ("/trickle", "/baddate"):
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                if self.path == "/baddate":
                    self.wfile.write(b"kvoffload_hits 1\n")
                    return
                try:
                    while not stop.wait(0.05):
                        self.wfile.write(b"vllm_x 1\n")
                        self.wfile.flush()
                except OSError:
                    pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever)
        self.thread.start()

    def close(self):
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def test_a_metrics_endpoint_that_trickles_errs_or_sends_no_date_is_judged_within_the_timeout(
    tmp_path,
):
    path = tmp_path / "a.json"
    path.write_text(json.dumps(config()))
    m = _Metrics()
    try:
        base = f"http://127.0.0.1:{m.port}"
        r = doctor_process(
            "--json", str(path), "--timeout", "1",
            "--metrics", f"{base}/trickle", "--metrics", f"{base}/missing",
            "--metrics", f"{base}/baddate",
        )  # fmt: skip
    finally:
        m.close()
    found = {f["subject"]: f for f in json.loads(r.stdout)["findings"] if f["check"] == "metrics"}
    assert found[f"{base}/trickle"]["status"] == "warn", found  # answers, no kvoffload metric
    missing = found[f"{base}/missing"]
    assert missing["status"] == "fail" and "HTTP 404" in missing["found"], missing
    skew = [f for f in json.loads(r.stdout)["findings"] if f["subject"].startswith(f"{base}/bad")]
    assert [f["status"] for f in skew if f["check"] == "clock skew"] == ["warn"], skew


def test_a_peer_address_zmq_cannot_dial_is_a_failed_row_not_a_traceback(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        c = config(secondary_tiers=[p2p("tcp", free_port(), [f"*:{port}"])])
        status, found = doctor(tmp_path, [c], "--timeout", "1")
    f = one(found, "p2p peer")
    assert status == 1 and f["status"] == "fail", f


def test_secrets_are_never_printed(tmp_path):
    """A wrongly typed cache_salt (doctor and check), a YAML syntax error on a secret's line,
    a cache_salt compared between instances."""
    secret = "TOPSECRET-0123456789abcdef0123456789"
    typed = tmp_path / "typed.json"
    typed.write_text(json.dumps(config(cache_salt=[secret])))
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        "model: m\nkv-transfer-config:\n  kv_connector_extra_config:\n    secondary_tiers:\n"
        f'      - {{type: p2p, port: 7000, secret: "{secret}}}\n'
    )
    salted = tmp_path / "salted.json"
    salted.write_text(json.dumps(config(cache_salt=secret)))
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(config()))
    for args in (
        ["doctor", "--json", str(typed)],
        ["doctor", str(typed)],
        ["check", str(typed)],
        ["check", "--json", str(typed)],
        ["doctor", str(broken)],
        ["doctor", "--json", str(salted), str(plain)],
        ["doctor", str(salted), str(plain)],
    ):
        result = CliRunner().invoke(main, args, env={})
        assert result.exit_code in (1, 2), (args, result.output)
        assert "TOPSECRET" not in result.output, (args, result.output)
    result = CliRunner().invoke(main, ["doctor", str(broken)], env={})
    assert "line 6" in result.output, result.output  # where, without the line


def serve_config(tmp_path, name: str, text: str, **extra) -> str:
    """A vLLM serve configuration file: ``text`` (its options) and kvoffload's config."""
    transfer = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    transfer["kv_connector_extra_config"] = config(**extra)
    path = tmp_path / name
    path.write_text(text + f"kv-transfer-config: {json.dumps(transfer)}\n")
    return str(path)


def test_engine_block_size_revision_and_dtype_aliases_are_compared_as_the_namespace_does(
    tmp_path,
):
    a = serve_config(tmp_path, "a.yaml", "model: m\ndtype: half\nblock-size: 16\n", block_size=64)
    b = serve_config(
        tmp_path, "b.YAML", "model: m\ndtype: float16\nblock-size: 32\n", block_size=64
    )
    result = CliRunner().invoke(main, ["doctor", "--json", a, b], env={})
    found = json.loads(result.output)["findings"]
    assert one(found, "namespace: kv dtype")["status"] == "ok"  # half is float16
    assert one(found, "namespace: chunk size")["status"] == "ok"  # 64 tokens both
    f = one(found, "namespace: engine block size")  # but the groups' blocks differ
    assert f["status"] == "fail" and "16 tokens" in f["found"] and "32 tokens" in f["found"], f
    assert result.exit_code == 1

    status, found = doctor(tmp_path, [config(model_revision="v1"), config(model_revision="v2")])
    f = one(found, "namespace: revision")
    assert status == 1 and f["status"] == "fail" and "v2" in f["found"], f


def test_every_namespace_field_is_compared_or_left_to_the_engine():
    from kvoffload.namespace import KeyedNamespace
    from kvoffload.tools import doctor as doc

    fields = {f.name for f in msgspec.structs.fields(KeyedNamespace)}
    assert fields == set(doc.NAMESPACE_ROWS), fields ^ set(doc.NAMESPACE_ROWS)
    assert {"revision", "engine block size", "parallel geometry"} <= set(doc.namespace_rows())


def test_integrity_keys_are_compared_by_the_place_they_store_in_and_the_keys_id(tmp_path):
    root = str(tmp_path / "root")
    key = "k" * 40

    def tier(name, env):
        return {"type": "fs", "name": name, "root_dir": root, "integrity_key_env": env}

    keyed = config(secondary_tiers=[tier("nvme", "KEY_A")])
    unkeyed = config(secondary_tiers=[{"type": "fs", "root_dir": root}])
    env = {"KEY_A": key, "KEY_B": key, "KEY_C": "c" * 40}
    status, found = doctor(tmp_path, [keyed, unkeyed], "--same-host", env=env)
    f = one(found, "namespace: integrity key")  # another tier name, the same root
    assert status == 1 and f["status"] == "fail" and "keyed and unkeyed" in f["found"], f

    other_name = config(secondary_tiers=[tier("disk", "KEY_B")])  # the same key, another variable
    status, found = doctor(tmp_path, [keyed, other_name], "--same-host", env=env)
    f = one(found, "namespace: integrity key")
    assert f["status"] == "ok" and key not in json.dumps(found), f

    other_key = config(secondary_tiers=[tier("disk", "KEY_C")])
    status, found = doctor(tmp_path, [keyed, other_key], "--same-host", env=env)
    assert one(found, "namespace: integrity key")["status"] == "fail"
    status, found = doctor(tmp_path, [keyed, other_key], "--same-host", env={"KEY_A": key})
    assert one(found, "namespace: integrity key")["status"] == "warn"  # KEY_C not here


def test_a_file_holding_null_fails(tmp_path):
    path = tmp_path / "null.json"
    path.write_text("null")
    result = CliRunner().invoke(main, ["doctor", "--json", str(path)], env={})
    assert result.exit_code == 1, result.output
    f = one(json.loads(result.output)["findings"], "config")
    assert f["status"] == "fail" and "null" in f["found"], f


def test_other_machines_instances_are_not_judged_by_this_machine(tmp_path):
    """Without --same-host: another instance's /dev/shm need, its loopback peers and a root
    path named by two hosts are not this machine's."""
    huge = config(cpu_bytes_to_use=1 << 50)
    loop = config(secondary_tiers=[p2p("tcp", free_port(), [f"127.0.0.1:{free_port()}"])])
    status, found = doctor(tmp_path, [config(), huge, loop], env={"KVOFFLOAD_P2P_SECRET": "s" * 40})
    assert status == 0, [f for f in found if f["status"] == "fail"]
    assert "not probed" in one(found, "p2p peer")["found"]
    status, found = doctor(tmp_path, [config(), huge], "--same-host")
    assert status == 1  # here, it does not fit

    root = {"type": "fs", "root_dir": str(tmp_path / "root")}
    c = config(secondary_tiers=[root])
    status, found = doctor(tmp_path, [c, c])
    assert one(found, "shared fs root")["status"] == "warn"
    status, found = doctor(tmp_path, [c, c], "--same-host")
    assert one(found, "shared fs root")["status"] == "ok"


@contextlib.contextmanager
def zmq_peer(curve_secret: bytes | None = None):
    """A ZMQ ROUTER on a free loopback port that never answers (a CurveZMQ server with
    ``curve_secret``, else NULL: a socket without CurveZMQ); yields its port, closed after."""
    import zmq

    ctx = zmq.Context()
    peer = ctx.socket(zmq.ROUTER)
    peer.setsockopt(zmq.LINGER, 0)
    if curve_secret is not None:
        peer.curve_server = True
        peer.curve_secretkey = curve_secret
    try:
        yield peer.bind_to_random_port("tcp://127.0.0.1")
    finally:
        peer.close(linger=0)
        ctx.term()


def test_a_zmq_peer_without_curve_is_not_called_another_secret(tmp_path):
    with zmq_peer() as port:  # a ZMQ socket without CurveZMQ: auth none, or no p2p port
        c = config(secondary_tiers=[p2p("tcp", free_port(), [f"127.0.0.1:{port}"])])
        status, found = doctor(tmp_path, [c], "--timeout", "60")
    f = one(found, "p2p peer")
    assert status == 1 and "without CurveZMQ" in f["found"], f
    assert "auth failure" not in f["found"], f


@pytest.mark.parametrize("monitor", ["before the connect", "none"])
def test_a_zmq_peer_without_curve_is_named_when_the_probe_looks_after_its_handshake(
    tmp_path, monkeypatch, monitor
):
    """.ci/run on a clean clone (2026-12-04): the probe's monitor was attached after the connect; ZMQ's I/O thread had
    already failed the handshake (mechanism mismatch), which it never tries again, so no event
    came and the doctor said 'no answer to Hello'. Here the probe's socket is handed back only
    once the peer's first handshake is over (the peer's own monitor says so): the doctor's monitor,
    attached before the connect, heard it; and without one (as a libzmq that reports no event),
    the peer's greeting names the mismatch."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from kvoffload.tiers.p2p import node

    real = node.open_dealer
    ctx = zmq.Context()
    plain = ctx.socket(zmq.ROUTER)  # a ZMQ socket without CurveZMQ
    plain.setsockopt(zmq.LINGER, 0)
    # the peer's first handshake over: a mismatch it found, or the connection the probe closed
    # on finding it first (which side reads the other's greeting first varies)
    failed = plain.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_DISCONNECTED)
    port = plain.bind_to_random_port("tcp://127.0.0.1")

    def open_late(ctx, out, curve, before_connect=None):
        s = real(ctx, out, curve, before_connect if monitor == "before the connect" else None)
        assert failed.poll(60_000), "the peer's handshake did not end within 60 s"
        recv_monitor_message(failed)
        return s

    monkeypatch.setattr(node, "open_dealer", open_late)
    try:
        c = config(secondary_tiers=[p2p("tcp", free_port(), [f"127.0.0.1:{port}"])])
        status, found = doctor(tmp_path, [c], "--timeout", "5")
    finally:
        plain.disable_monitor()
        failed.close(linger=0)
        plain.close(linger=0)
        ctx.term()
    f = one(found, "p2p peer")
    assert status == 1 and "without CurveZMQ" in f["found"], f


def test_kv_event_messages_that_are_no_batch_or_carry_no_time_are_named(tmp_path):
    import zmq

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    payload = [b"kv-events", (1).to_bytes(8, "big"), os.urandom(64)]
    stop = threading.Event()

    def publish():
        while not stop.wait(0.02):
            pub.send_multipart(payload)

    thread = threading.Thread(target=publish)
    thread.start()
    try:
        status, found = doctor(
            tmp_path, [config()], "--events", f"tcp://127.0.0.1:{port}", "--events-wait", "60"
        )
        f = one(found, "KV events")
        assert status == 1 and "no KV event batch" in f["found"], f
        payload[2] = msgspec.msgpack.encode([float("nan"), []])
        status, found = doctor(
            tmp_path, [config()], "--events", f"tcp://127.0.0.1:{port}", "--events-wait", "60"
        )
    finally:
        stop.set()
        thread.join()
        pub.close(linger=0)
        ctx.term()
    assert one(found, "KV events")["status"] == "ok"
    skew = one(found, "clock skew")
    assert skew["status"] == "warn" and "no believable time" in skew["found"], skew


def test_secrets_written_in_the_files_are_compared_by_their_public_key(tmp_path):
    def tier(secret):
        return dict(p2p("tcp", free_port()), secret=secret)

    a, b = "a" * 40, "b" * 40
    status, found = doctor(
        tmp_path, [config(secondary_tiers=[tier(a)]), config(secondary_tiers=[tier(b)])]
    )
    f = one(found, "p2p secret")
    assert status == 1 and f["status"] == "fail" and "public key" in f["found"], f
    assert a not in json.dumps(found) and b not in json.dumps(found)
    status, found = doctor(
        tmp_path, [config(secondary_tiers=[tier(a)]), config(secondary_tiers=[tier(a)])]
    )
    assert one(found, "p2p secret")["status"] == "ok"


def test_events_endpoints_no_subscriber_reaches_and_unknown_seeds_are_warnings(tmp_path):
    inproc = config(kv_events={"endpoint": "inproc://kv"})
    missing = config(kv_events={"endpoint": f"ipc://{tmp_path / 'no-such-socket'}"})
    status, found = doctor(tmp_path, [inproc, missing], "--same-host")
    rows = {f["subject"].split(": ", 1)[1]: f for f in findings(found, "KV events")}
    assert "inside the engine's process" in rows["inproc://kv"]["found"], rows
    assert "no socket file" in rows[f"ipc://{tmp_path / 'no-such-socket'}"]["found"], rows
    assert all(f["status"] == "warn" for f in rows.values()), rows
    seed = one(found, "namespace: hash seed")  # no --hash-seed: not known, not "the same"
    assert seed["status"] == "warn" and "the same" not in seed["found"], seed


def test_a_silent_peer_without_auth_is_not_called_without_curvezmq():
    """Review: the greeting fallback ran for an ``auth: none`` probe too, which speaks NULL
    itself: a NULL peer too busy to answer Hello was called 'without CurveZMQ' (pointing at
    the secret) where both sides are right; it is 'no answer'."""
    from kvoffload.tools.doctor import probe_peer

    with zmq_peer() as port:  # speaks ZMTP with NULL, never answers Hello
        got = probe_peer(f"127.0.0.1:{port}", b"", None, 2.0)
    assert got.outcome == "no_answer", got


@pytest.mark.parametrize("auth", ["secret", "none"])
def test_a_peer_that_answers_with_bytes_that_are_not_zmq_is_named_so(auth):
    """Fresh user's attack (helper): a listener that greets with an SSH banner was called 'no
    answer to Hello' (libzmq reports no event for bytes that are not ZMTP), where the README
    promises such bytes are named as such."""
    import socket

    from kvoffload.tools.doctor import probe_peer

    srv = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            c.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
            conns.append(c)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        secret = os.urandom(32) if auth == "secret" else b""
        got = probe_peer(f"127.0.0.1:{srv.getsockname()[1]}", secret, None, 5.0)
    finally:
        stop.set()
        t.join()
        for c in conns:
            c.close()
        srv.close()
    # from the greeting read ("no ZMQ greeting"), or from a protocol error libzmq reports at
    # times ("breaks ZMQ's protocol"): either way named not ZMQ, never "no answer"
    assert got.outcome == "not_zmtp" and "ZMQ" in got.detail, got


def test_a_curvezmq_peer_probed_without_auth_is_named_as_needing_it():
    """Fresh user's attack (helper): an ``auth: none`` tier's probe (NULL) of a peer that
    requires CurveZMQ was called 'without CurveZMQ' or 'auth failure: another secret', run to
    run; it is the peer that needs CurveZMQ: the auth settings differ."""
    import zmq

    from kvoffload.tools.doctor import probe_peer

    with zmq_peer(curve_secret=zmq.curve_keypair()[1]) as port:
        got = probe_peer(f"127.0.0.1:{port}", b"", None, 2.0)
    assert got.outcome == "needs_curve", got
