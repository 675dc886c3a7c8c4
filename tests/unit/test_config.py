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
    cfg = parse_config(
        {
            **BASE,
            "spec_name": "KVOffloadSpec",
            "spec_module_path": "kvoffload.vllm",
            "blocks_per_chunk": 2,
            "offload_prompt_only": True,
            "canonical_layout": False,
            "lock": None,
            "config_info": {},
            "expedited": True,
        }
    )
    assert (cfg.spec_name, cfg.spec_module_path) == ("KVOffloadSpec", "kvoffload.vllm")
    assert cfg.blocks_per_chunk == 2 and cfg.offload_prompt_only is True
    assert cfg.canonical_layout is False and cfg.expedited is True


def test_c21_misspelled_top_level_key_suggests_the_right_one():
    msg = fails({**BASE, "evicton_policy": "lru"})
    assert msg.startswith(
        "kv_connector_extra_config: unknown key 'evicton_policy' "
        "(did you mean 'eviction_policy'?); allowed keys: cpu_bytes_to_use, "
    ), msg


def test_c21_misspelled_tier_key_names_the_tier_path(tmp_path):
    tier = {"type": "fs", "root_dir": str(tmp_path / "kv"), "max_byte": 10}
    msg = fails({**BASE, "secondary_tiers": [tier]})
    assert msg.startswith(
        "kv_connector_extra_config.secondary_tiers[0]: unknown key 'max_byte' "
        "(did you mean 'max_bytes'?); allowed keys: "
    ), msg
    assert ", max_bytes," in msg  # the allowed keys are the fs tier's own


def test_c21_unknown_tier_type():
    msg = fails({**BASE, "secondary_tiers": [{"type": "fss", "root_dir": "/tmp"}]})
    assert msg.startswith(
        "kv_connector_extra_config.secondary_tiers[0].type: unknown tier type "
        "'fss' (did you mean 'fs'?); built-in types: fs, obj, memory, p2p"
    ), msg


@pytest.mark.parametrize(
    "value, why",
    [
        (-5, "Expected `int` >= 1 (given: -5)"),
        (0, "Expected `int` >= 1 (given: 0)"),
        (
            "10GB",
            "a size in bytes, as an integer, not the string '10GB' "
            "(10 GiB is 10737418240, 10 GB is 10000000000)",
        ),
        (
            "lots",
            "a size in bytes, as an integer (e.g. 1073741824 for 1 GiB), not the string 'lots'",
        ),
        ("4096", "a size in bytes, as an integer: write 4096 without quotes"),
        (1.5, "Expected `int`, got `float` (given: 1.5); allowed: an integer > 0"),
    ],
)
def test_c21_wrong_unit_or_type_for_sizes(value, why):
    msg = fails({"cpu_bytes_to_use": value})
    assert msg == f"kv_connector_extra_config.cpu_bytes_to_use: {why}"


FS_MAX_BYTES_FORMS = (
    '; also allowed: "unbounded", null (auto: 50% of the free space on root_dir\'s filesystem at '
    "start, plus this namespace's chunks there)"
)


@pytest.mark.parametrize(
    "max_bytes, why",
    [
        (0, "Expected `int` >= 1 (given: 0)"),
        (-1, "Expected `int` >= 1 (given: -1)"),
        (
            "10GB",
            "a size in bytes, as an integer, not the string '10GB' (10 GiB is 10737418240, "
            f"10 GB is 10000000000){FS_MAX_BYTES_FORMS}",
        ),
        (
            "1GiB",
            f"a size in bytes, as an integer, not the string '1GiB' (1 GiB is 1073741824){FS_MAX_BYTES_FORMS}",
        ),
    ],
)
def test_c21_tier_capacity_must_be_positive_bytes(tmp_path, max_bytes, why):
    tier = {"type": "fs", "root_dir": str(tmp_path / "kv"), "max_bytes": max_bytes}
    msg = fails({**BASE, "secondary_tiers": [tier]})
    assert msg == f"kv_connector_extra_config.secondary_tiers[0].max_bytes: {why}"


def test_missing_required_keys_are_named():
    fails({}, "cpu_bytes_to_use")
    fails({**BASE, "secondary_tiers": [{"type": "fs"}]}, "secondary_tiers[0]", "root_dir")
    fails({**BASE, "secondary_tiers": [{"root_dir": "/x"}]}, "secondary_tiers[0].type")


def test_unknown_policy_and_conflicting_chunk_sizes():
    fails({**BASE, "eviction_policy": "lfu"}, "eviction_policy", "'lfu'", "lru", "arc")
    fails({**BASE, "eviction_policy": "arcc"}, "did you mean 'arc'")
    fails({**BASE, "blocks_per_chunk": 2, "block_size": 32}, "blocks_per_chunk", "block_size")


def test_out_of_tree_tier_errors():
    fails(
        {**BASE, "secondary_tiers": [{"type": "Nope", "module_path": "no.such.module"}]},
        "secondary_tiers[0].module_path",
        "no.such.module",
    )
    fails(
        {**BASE, "secondary_tiers": [{"type": "OrderedDict", "module_path": "collections"}]},
        "not a SecondaryTierManager",
    )


@pytest.mark.parametrize(
    "source, module_path, expected",
    [
        ('raise RuntimeError("boom")', "kvo_raises_at_import", "RuntimeError: boom"),
        ("def f(:", "kvo_bad_syntax", "SyntaxError"),
        (None, 5, "expected an absolute module name"),
        (None, "", "expected an absolute module name"),
        (None, ".relative", "expected an absolute module name"),
    ],
)
def test_an_out_of_tree_module_that_cannot_be_imported_is_a_config_error(
    tmp_path, monkeypatch, source, module_path, expected
):
    """Whatever an out-of-tree module's import raises (or a module_path that is no module name)
    is a config error naming the key, for a tier and for a policy; never a traceback."""
    if source is not None:
        (tmp_path / f"{module_path}.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
    fails(
        {**BASE, "secondary_tiers": [{"type": "X", "module_path": module_path}]},
        "secondary_tiers[0].module_path",
        expected,
    )
    fails(
        {**BASE, "eviction_policy": "X", "cache_policy_module_path": module_path},
        "cache_policy_module_path",
    )


def test_duplicate_tier_names():
    t = {"type": "memory", "max_bytes": 100}
    fails({**BASE, "secondary_tiers": [t, t]}, "duplicate tier name 'memory'")
    parse_config({**BASE, "secondary_tiers": [t, {**t, "name": "mem2"}]})


def test_tier_entries_are_parsed_once_into_typed_specs(tmp_path):
    from kvoffload.tiers.fs import FsTier, FsTierConfig
    from kvoffload.tiers.memory import MemoryTier, MemoryTierConfig

    cfg = parse_config(
        {
            **BASE,
            "secondary_tiers": [
                {"type": "fs", "name": "nvme", "root_dir": str(tmp_path), "max_bytes": 1 << 30},
                {"type": "memory", "max_bytes": 4096},
            ],
        }
    )
    fs, mem = cfg.secondary_tiers
    assert (fs.name, fs.type, fs.module_path) == ("nvme", "fs", None)
    assert isinstance(fs.config, FsTierConfig) and fs.config.max_bytes == 1 << 30
    assert fs.tier_class is FsTier
    assert (mem.name, mem.tier_class) == ("memory", MemoryTier)
    assert mem.config == MemoryTierConfig(max_bytes=4096)
    fails({**BASE, "secondary_tiers": "fs"}, "kv_connector_extra_config.secondary_tiers:")
    fails({**BASE, "secondary_tiers": ["fs"]}, "kv_connector_extra_config.secondary_tiers[0]:")


def test_a_wrongly_typed_value_is_repeated_in_its_error_unless_it_may_be_a_secret():
    msg = fails({**BASE, "block_size": [16]})
    assert msg == (
        "kv_connector_extra_config.block_size: Expected `int | null`, got `array` (given: [16]); "
        "allowed: an integer > 0, or null"
    )
    # a secret given as a number by mistake is still the secret: not echoed into logs
    msg = fails(
        {**BASE, "secondary_tiers": [{"type": "p2p", "secret": 918273645546372819}]}, "secret"
    )
    assert "918273645546372819" not in msg and "given" not in msg, msg


def test_the_p2p_engine_switch_interval_is_bounded_and_may_be_left_alone():
    def p2p(**kw):
        return {**BASE, "secondary_tiers": [{"type": "p2p", **kw}]}

    assert parse_config(p2p()).secondary_tiers[0].config.engine_switch_interval_s == 0.0005
    assert (
        parse_config(p2p(engine_switch_interval_s=None))
        .secondary_tiers[0]
        .config.engine_switch_interval_s
        is None
    )
    msg = fails(p2p(engine_switch_interval_s=0.00001), "engine_switch_interval_s")
    assert ">= 0.0001" in msg and "allowed: a number from 0.0001 to 0.1, or null" in msg, msg
    msg = fails(p2p(engine_switch_interval_s="fast"), "engine_switch_interval_s")
    assert msg.endswith("allowed: a number from 0.0001 to 0.1, or null"), msg
    msg = fails(p2p(engine_switch_interval_s=1), "engine_switch_interval_s")
    assert "<= 0.1" in msg, msg


def test_never_slower_than_recompute_is_the_default_with_live_estimates():
    cfg = parse_config(BASE)
    assert cfg.slower_than_recompute == "recompute"
    assert cfg.recompute_margin == 1.5 and cfg.promotion_overrun_factor == 3.0
    assert cfg.recompute_tokens_per_s is None  # measured from the engine's steps


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("slower_than_recompute", "wait", "allowed: recompute, serve"),
        ("recompute_margin", 0.9, ">= 1.0"),
        ("promotion_overrun_factor", 0.5, ">= 1.0"),
        ("recompute_tokens_per_s", 0, "> 0.0"),
        ("recompute_tokens_per_s", "fast", "Expected `float | null`"),
    ],
)
def test_never_slower_than_recompute_settings_are_checked(key, value, why):
    fails({**BASE, key: value}, f"kv_connector_extra_config.{key}", why)
