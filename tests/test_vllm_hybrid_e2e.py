"""End to end on a real vLLM-CPU server with a tiny random-weight Gemma-3 style model (sliding-window
and full-attention layers: two kinds of KV-cache group), issue 14."""

import os
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
pytest.importorskip("vllm")

from hybrid_models import prepare_hybrid_model  # noqa: E402

from kvoffload.tools.demo import SYSTEM, chat, maintenance_log  # noqa: E402
from kvoffload.tools.vllm_server import (  # noqa: E402
    ServerSpec,
    VLLMServer,
    cached_by_source,
)

DOC_TOKENS = 700


@pytest.fixture(scope="module")
def gemma3_dir():
    return str(prepare_hybrid_model("gemma3", os.environ.get("KVOFFLOAD_GEMMA3_DIR")))


@pytest.fixture(scope="module")
def server(gemma3_dir, tmp_path_factory):
    """A device cache that holds about one prompt, a host tier that holds several."""
    logs = tmp_path_factory.mktemp("logs")
    offload = {
        "spec_name": "KVOffloadSpec",
        "spec_module_path": "kvoffload.vllm",
        "cpu_bytes_to_use": 64 << 20,
    }
    spec = ServerSpec(
        model=gemma3_dir,
        kv_cache_tokens=40,  # in SmolLM2 tokens: about 1.8 MB, ~110 blocks of 32 tokens x 1 layer
        block_size=32,
        max_model_len=1024,
        offload=offload,
        log_path=str(logs / "server.log"),
        # a small prefill budget: a window group is admitted with window + budget tokens
        extra_args=["--max-num-batched-tokens", "256"],
    )
    srv = VLLMServer(spec).start()
    srv.log_path = spec.log_path
    yield srv
    srv.stop()
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


def test_sliding_window_model_reloads_from_the_host_token_identical(server, gemma3_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma3_dir)
    docs = [maintenance_log(tokenizer, 500 + i, DOC_TOKENS) for i in range(3)]
    first = [chat(server.url, conversation(d), 8) for d in docs]
    before = server.metrics()
    again = chat(server.url, conversation(docs[0]), 8)  # evicted from the device by the others
    after = server.metrics()
    assert again.token_ids == first[0].token_ids
    assert again.cached_tokens >= 0.8 * again.prompt_tokens
    assert cached_by_source(before, after).get("host", 0) > 0
    with open(server.log_path) as f:
        log = f.read()
    groups = [line for line in log.splitlines() if "kvoffload: KV group" in line]
    assert any("sliding_window" in g and "its window reaches" in g for g in groups), groups
    assert any("full_attention" in g and "every chunk of the prefix" in g for g in groups), groups
