"""Cache identity in process: every part of a namespace changes its id, and chunk keys chain their
prefixes. That namespaces never share chunks, on real tiers, and that keys are the same in every
process is tests/integration/test_namespace.py."""

import numpy as np
from helpers import ROW, namespace

from kvoffload.namespace import chunk_keys


def test_parallel_geometry_layout_and_salt_change_the_namespace():
    base = namespace()
    for change in (
        dict(tp_size=2),
        dict(pp_size=2),
        dict(layout="vllm-direct-v1:HND"),
        dict(cache_salt="tenant-a"),
        dict(tokens_per_chunk=32),
        dict(row_bytes=2 * ROW),
        dict(format_version=99),
    ):
        assert namespace(**change).id() != base.id(), change


def test_chunk_keys_chain_prefixes():
    a = chunk_keys(np.arange(48), 16)
    b = chunk_keys(np.arange(40), 16)
    assert a[:2] == b and len(a) == 3 and len(a[0]) == 20
    c = chunk_keys(np.r_[np.arange(16), np.arange(100, 116)], 16)
    assert c[0] == a[0] and c[1] != a[1]
    assert chunk_keys(np.arange(32), 16, group_idx=1)[0][:16] == a[0][:16]
