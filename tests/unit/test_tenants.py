"""Tenant ids and tenant keys (kvoffload.tenants) and the names they give on disk: what a salt
becomes, and that nothing else can name a tenant's directory."""

import pytest

from kvoffload.tenants import tenant_id, tenant_key
from kvoffload.workers.chunkfile import is_tenant_id, tenant_dir, tenant_from_dir


def test_a_tenant_id_is_32_hex_digits_the_same_everywhere_and_never_the_salt():
    salt = "acme-0123456789"
    tid = tenant_id(salt)
    assert is_tenant_id(tid) and tid == tenant_id(salt)  # deterministic: no per-process seed
    assert salt not in tid and tenant_id(salt + "x") != tid
    assert tenant_id(salt, secret=b"s" * 32) != tid  # a secret changes every id
    for bad in ("", None):
        with pytest.raises(ValueError, match="cache_salt"):
            tenant_id(bad)  # type: ignore[arg-type]


def test_tenant_keys_of_one_engine_key_differ_per_tenant_and_keep_the_group_suffix():
    a, b = tenant_id("a"), tenant_id("b")
    for key in (b"\x01" * 16 + (3).to_bytes(4, "big"), b"\x02" * 32 + (0).to_bytes(4, "big")):
        ka, kb = tenant_key(key, a), tenant_key(key, b)
        assert len(ka) == len(kb) == 20
        assert len({ka, kb, key}) == 3  # three tenants (none included): three keys
        assert ka[-4:] == kb[-4:] == key[-4:]  # the KV-group index the hybrid layout reads
        assert ka == tenant_key(key, a)


def test_only_a_tenant_id_names_a_tenant_directory():
    tid = tenant_id("a")
    assert tenant_dir(tid) == "t-" + tid and tenant_from_dir("t-" + tid) == tid
    for bad in ("../x", tid.upper(), tid[:-1], tid + "0", "t-" + tid, "", "/" + tid[1:]):
        with pytest.raises(ValueError, match="tenant id"):
            tenant_dir(bad)
        with pytest.raises(ValueError, match="tenant id"):
            tenant_key(b"k" * 20, bad)
    for name in ("t-../x", "t-" + tid.upper(), tid, "t-", "00"):
        assert tenant_from_dir(name) is None
