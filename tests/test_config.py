"""Bad configuration fails at start with a message naming the key (CASES C21, steps 2-3)."""

import pytest

from kvoffload.config import ConfigError, describe, parse_config

BASE = {"cpu_bytes_to_use": 1 << 20}


def fails(cfg, *fragments):
    with pytest.raises(ConfigError) as e:
        parse_config(cfg)
    for f in fragments:
        assert f in str(e.value), str(e.value)
    return str(e.value)


def test_minimal_config_and_defaults_are_described():
    cfg = parse_config(BASE)
    assert cfg.eviction_policy == "lru" and cfg.secondary_tiers == []
    assert '"cpu_bytes_to_use":1048576' in describe(cfg)


def test_vllm_keys_are_accepted():
    parse_config({**BASE, "spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.vllm",
                  "blocks_per_chunk": 2, "offload_prompt_only": True, "canonical_layout": False,
                  "lock": None, "config_info": {}, "expedited": True})


def test_c21_misspelled_top_level_key_suggests_the_right_one():
    msg = fails({**BASE, "evicton_policy": "lru"}, "evicton_policy", "did you mean 'eviction_policy'")
    assert "kv_connector_extra_config" in msg


def test_c21_misspelled_tier_key_names_the_tier_path():
    fails({**BASE, "secondary_tiers": [{"type": "fs", "root_dir": "/tmp/x", "max_byte": 10}]},
          "secondary_tiers[0]", "max_byte", "did you mean 'max_bytes'")


def test_c21_unknown_tier_type():
    fails({**BASE, "secondary_tiers": [{"type": "fss", "root_dir": "/tmp"}]},
          "secondary_tiers[0].type", "'fss'", "did you mean 'fs'")


@pytest.mark.parametrize("value, fragment", [
    (-5, "cpu_bytes_to_use"),
    (0, "cpu_bytes_to_use"),
    ("10GB", "cpu_bytes_to_use"),
    (1.5, "cpu_bytes_to_use"),
])
def test_c21_wrong_unit_or_type_for_sizes(value, fragment):
    msg = fails({"cpu_bytes_to_use": value}, fragment)
    assert "Expected" in msg or ">" in msg


@pytest.mark.parametrize("max_bytes", [0, -1, "10GB"])
def test_c21_tier_capacity_must_be_positive_bytes(max_bytes):
    fails({**BASE, "secondary_tiers": [{"type": "fs", "root_dir": "/tmp/x", "max_bytes": max_bytes}]},
          "secondary_tiers[0].max_bytes")


def test_missing_required_keys_are_named():
    fails({}, "cpu_bytes_to_use")
    fails({**BASE, "secondary_tiers": [{"type": "fs"}]}, "secondary_tiers[0]", "root_dir")
    fails({**BASE, "secondary_tiers": [{"root_dir": "/x"}]}, "secondary_tiers[0].type")


def test_unknown_policy_and_conflicting_chunk_sizes():
    fails({**BASE, "eviction_policy": "lfu"}, "eviction_policy", "'lfu'", "lru", "arc")
    fails({**BASE, "eviction_policy": "arcc"}, "did you mean 'arc'")
    fails({**BASE, "blocks_per_chunk": 2, "block_size": 32}, "blocks_per_chunk", "block_size")


def test_out_of_tree_tier_errors():
    fails({**BASE, "secondary_tiers": [{"type": "Nope", "module_path": "no.such.module"}]},
          "secondary_tiers[0].module_path", "no.such.module")
    fails({**BASE, "secondary_tiers": [{"type": "OrderedDict", "module_path": "collections"}]},
          "not a SecondaryTierManager")


def test_duplicate_tier_names():
    t = {"type": "memory", "max_bytes": 100}
    fails({**BASE, "secondary_tiers": [t, t]}, "duplicate tier name 'memory'")
    parse_config({**BASE, "secondary_tiers": [t, {**t, "name": "mem2"}]})
