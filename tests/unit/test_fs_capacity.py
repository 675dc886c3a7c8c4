"""The fs tier's capacity settings, parsed in process: the settings that cannot work (C36) and
those out of their range are refused naming the key, as is a ``root_dir`` the tier cannot make.
The capacity itself, with real workers and real files, is tests/integration/test_fs_capacity.py."""

import pytest
from helpers import ROW

from kvoffload.config import ConfigError, parse_config
from kvoffload.workers.chunkfile import HEADER_BYTES

FB = HEADER_BYTES + ROW  # bytes of one chunk file
BASE = {"cpu_bytes_to_use": 1 << 20}


def _refused(tmp_path, key, value) -> str:
    tier = {"type": "fs", "root_dir": str(tmp_path), key: value}
    with pytest.raises(ConfigError) as e:
        parse_config({**BASE, "secondary_tiers": [tier]})
    assert f"secondary_tiers[0].{key}:" in str(e.value)
    return str(e.value)


@pytest.mark.parametrize(
    "key,value,expected",
    [
        ("job_timeout_s", float("inf"), "<= 86400"),  # a hung worker would never be replaced
        ("breaker_cooldown_s", float("inf"), "<= 86400"),  # an open breaker would never close
        ("negative_ttl_s", float("inf"), "<= 86400"),  # another instance's chunks never seen
        ("failed_load_ttl_s", float("inf"), "<= 86400"),
        ("min_free_fraction", 1.0, "< 1"),  # nothing could ever be written
    ],
)
def test_c36_settings_that_cannot_work_are_refused_naming_key_and_range(
    tmp_path, key, value, expected
):
    assert expected in _refused(tmp_path, key, value)


@pytest.mark.parametrize(
    "key,value,expected",
    [
        ("negative_ttl_s", -1.0, ">= 0"),
        ("failed_load_ttl_s", float("nan"), ""),
        ("max_bytes", "unbound", ""),
        ("max_bytes", 0, ""),
    ],
)
def test_settings_out_of_their_range_are_refused_naming_the_key(tmp_path, key, value, expected):
    assert expected in _refused(tmp_path, key, value)


def test_c51_a_breaker_max_cooldown_below_the_first_cooldown_is_refused_with_the_fix(tmp_path):
    """The bound of a breaker's recovery cannot be shorter than its first cooldown: the fs and obj
    tiers refuse it at parse, naming the key and what to set; unset, it is 4 times the first
    cooldown (what the tier runs with, and ``kvoffload check`` shows)."""
    from kvoffload.config import effective_config, parse_tier_config

    tier = {"type": "fs", "root_dir": str(tmp_path), "breaker_cooldown_s": 2.0}
    with pytest.raises(ConfigError) as e:
        parse_config({**BASE, "secondary_tiers": [{**tier, "breaker_max_cooldown_s": 1.5}]})
    assert (
        "secondary_tiers[0].breaker_max_cooldown_s: 1.5 s is below breaker_cooldown_s (2 s), the "
        "first cooldown; set it to at least 2 (equal: no back-off), or lower breaker_cooldown_s"
    ) in str(e.value)
    with pytest.raises(ConfigError, match=r"\.breaker_max_cooldown_s: 0\.5 s is below"):
        parse_tier_config(
            {"type": "obj", "bucket": "b", "breaker_max_cooldown_s": 0.5}, "secondary_tiers[0]"
        )
    for extra, expected in (({}, 8.0), ({"breaker_max_cooldown_s": 2.0}, 2.0)):
        cfg = effective_config(parse_config({**BASE, "secondary_tiers": [{**tier, **extra}]}))
        assert cfg.secondary_tiers[0].config.breaker_max_cooldown_s == expected


def test_a_root_dir_that_cannot_be_made_is_refused_with_the_reason(tmp_path):
    """``kvoffload check`` and the tier's start agree on a ``root_dir`` the tier cannot use, and
    the message names why: a file where a directory of the path must be (an executable file too:
    it once passed the check and the start failed with ``Not a directory``), a file as the root."""
    blocker = tmp_path / "afile"
    blocker.write_bytes(b"")
    for mode in (0o644, 0o755):
        blocker.chmod(mode)
        msg = _refused(tmp_path, "root_dir", str(blocker / "kv"))
        assert f"{str(blocker)!r} is not a directory" in msg, msg
    assert "exists and is not a directory" in _refused(tmp_path, "root_dir", str(blocker))


@pytest.mark.parametrize("key", ["connect_timeout_s", "read_timeout_s", "job_timeout_s"])
def test_c36_obj_tier_durations_must_be_finite(key):
    from kvoffload.config import parse_tier_config

    with pytest.raises(ConfigError, match=rf"\.{key}: .*<= 86400"):
        parse_tier_config({"type": "obj", "bucket": "b", key: float("inf")}, "secondary_tiers[0]")


def test_max_bytes_unbounded_and_numbers_are_accepted(tmp_path):
    for value in ("unbounded", 10 * FB, None):
        tier = {"type": "fs", "root_dir": str(tmp_path)}
        if value is not None:
            tier["max_bytes"] = value
        spec = parse_config({**BASE, "secondary_tiers": [tier]}).secondary_tiers[0]
        assert spec.type == "fs" and spec.config.max_bytes == value  # kept as written
