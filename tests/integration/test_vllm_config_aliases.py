"""Tiers started from vLLM 0.33-shaped tier configs (``n_read_threads`` and the other keys of vLLM's
``TieringOffloadingSpec``) do their work: an fs tier's thread counts reach its worker processes, and
an obj tier configured with vLLM's ``store_config`` round-trips against a real S3 server on
loopback. The parsing of those configs is tests/unit/test_vllm_config_aliases.py.
"""

import numpy as np
from helpers import HIT, NO_FLOOR, Rig, keys_for, payload
from s3 import ACCESS, SECRET, new_bucket, start_moto

from kvoffload.ipc.channels import LOADS, STORES


def test_vllm_fs_thread_counts_reach_the_worker_processes(tmp_path):
    raw = {
        "type": "fs",
        "root_dir": str(tmp_path),
        "n_read_threads": 6,
        "n_write_threads": 3,
        "read_workers": 2,
        "write_workers": 1,
        "locality": "REMOTE",
        **NO_FLOOR,
    }
    with Rig([raw], num_slots=4) as rig:
        fs = rig.fs
        assert fs._spec(0, b"r0", LOADS).io_threads == 3
        assert fs._spec(0, b"w0", STORES).io_threads == 3
        assert fs.locality == "REMOTE"
        keys = keys_for(2)
        rig.store(keys)
        rig.evict_all()
        assert rig.resolve(keys) == [HIT, HIT]
        for k, row in zip(keys, rig.read(keys)):
            assert np.array_equal(row, payload(k))


def test_vllm_obj_store_config_against_a_real_s3_server():
    srv, endpoint = start_moto()
    try:
        host = endpoint.removeprefix("http://")
        bucket = new_bucket(endpoint)
        raw = {
            "type": "obj",
            "store_config": {
                "bucket": bucket,
                "endpoint_override": host,
                "scheme": "http",
                "access_key": ACCESS,
                "secret_key": SECRET,
                "region": "us-east-1",
            },
            "prefix": "vllm-shaped",
            "io_threads": 2,
            "addressing_style": "path",
            "io_workers": 1,
            "n_read_threads": 5,
        }
        with Rig([raw], num_slots=4) as rig:
            obj = rig.fs
            assert obj._spec(0, b"r0", LOADS).io_threads == 5
            assert obj._spec(0, b"w0", STORES).io_threads == 2
            assert obj.io_config().max_connections == 7  # one per thread, plus 2
            keys = keys_for(3)
            rig.store(keys)
            rig.evict_all()
            assert rig.resolve(keys) == [HIT] * 3
            for k, row in zip(keys, rig.read(keys)):
                assert np.array_equal(row, payload(k))
    finally:
        srv.stop()
