"""Cache identity: namespaces never share chunks; keys are deterministic across processes. What a
namespace's id is made of, in process: tests/unit/test_namespace.py."""

import os
import re
import subprocess
import sys
import textwrap
import unicodedata

import numpy as np
import pytest
from helpers import HIT, MISS, TESTS_DIR, Rig, fs_tier, keys_for, namespace

from kvoffload.namespace import chunk_keys


def store_fill(rig, keys, value):
    rig.store(keys, fill=value)


def read_back(rig, keys):
    res = rig.resolve(keys)
    if res != [HIT] * len(keys):
        return None
    return rig.read(keys)


def files_under(root):
    return sorted(os.path.join(d, n) for d, _, ns in os.walk(root) for n in ns if n.endswith(".kv"))


def test_c01_kv_dtype_is_part_of_the_identity(tmp_path):
    t = keys_for(4)  # 64 tokens
    a_ns = namespace(model="m", kv_dtype="bfloat16")
    b_ns = namespace(model="m", kv_dtype="float8_e4m3")
    with Rig([fs_tier(tmp_path)], ns=a_ns) as a:
        store_fill(a, t, 0xA1)
    with Rig([fs_tier(tmp_path)], ns=b_ns) as b:
        assert b.resolve(t) == [MISS] * 4
        store_fill(b, t, 0xB2)
    assert a_ns.id() != b_ns.id()
    files = files_under(tmp_path)  # A's and B's files sit in their own namespace directories
    assert len(files) == 8
    assert sorted({os.path.relpath(f, tmp_path).split(os.sep)[0] for f in files}) == sorted(
        [a_ns.id(), b_ns.id()]
    )
    for ns, value in ((a_ns, 0xA1), (b_ns, 0xB2)):
        with Rig([fs_tier(tmp_path)], ns=ns) as r:
            rows = read_back(r, t)
            assert rows is not None and all((row == value).all() for row in rows)


def test_c02_model_revision_and_local_path_are_part_of_the_identity(tmp_path):
    t = keys_for(3)
    r1 = namespace(model="org/m", revision="r1")
    with Rig([fs_tier(tmp_path)], ns=r1) as a:
        a.store(t)
        expected = a.read(t)
    with Rig([fs_tier(tmp_path)], ns=namespace(model="org/m", revision="r2")) as b:
        assert b.resolve(t) == [MISS] * 3
    with Rig([fs_tier(tmp_path)], ns=namespace(model="org/m", revision="r1")) as c:
        rows = read_back(c, t)
        assert rows is not None and all(np.array_equal(x, y) for x, y in zip(rows, expected))
    # no revision known: two local model directories given under the same name stay apart
    p1 = namespace(model="model", model_path="/models/a")
    p2 = namespace(model="model", model_path="/models/b")
    assert p1.id() != p2.id()
    with Rig([fs_tier(tmp_path)], ns=p1) as a:
        a.store(t)
    with Rig([fs_tier(tmp_path)], ns=p2) as b:
        assert b.resolve(t) == [MISS] * 3
    assert namespace(model_fingerprint="x").id() != namespace(model_fingerprint="y").id()


def test_c03_tensor_parallel_rank_is_part_of_the_identity(tmp_path):
    r0 = namespace(tp_size=2, tp_rank=0)
    r1 = namespace(tp_size=2, tp_rank=1)
    # All 50 stores in flight at once (the race the case is about): no pin budget drops any.
    with (
        Rig([fs_tier(tmp_path, write_workers=2)], ns=r0, num_slots=64, tier_pin_fraction=1.0) as a,
        Rig([fs_tier(tmp_path, write_workers=2)], ns=r1, num_slots=64, tier_pin_fraction=1.0) as b,
    ):
        for i in range(50):
            t = keys_for(1, seed=100 + i)
            a.store(t, fill=0x00, wait=False)
            b.store(t, fill=0x11, wait=False)
        a.tm.wait_idle(120)
        b.tm.wait_idle(120)
    assert len(files_under(tmp_path)) == 100  # two distinct files per T
    with (
        Rig([fs_tier(tmp_path)], ns=r0, num_slots=64) as a,
        Rig([fs_tier(tmp_path)], ns=r1, num_slots=64) as b,
    ):
        for i in range(0, 50, 10):
            t = [k for j in range(10) for k in keys_for(1, seed=100 + i + j)]
            assert all((row == 0x00).all() for row in read_back(a, t))
            assert all((row == 0x11).all() for row in read_back(b, t))


_C04_PAIRS = [
    ("a/b", "a-SEP-b"),
    ("a/b", "a_b"),
    ("a/b", "a%2Fb"),
    ("../../etc", "etc"),
    ("/abs/model", "abs/model"),
    ("模型/ü", unicodedata.normalize("NFD", "模型/ü")),
]


@pytest.mark.parametrize("name_a, name_b", _C04_PAIRS)
def test_c04_model_names_never_collide_or_escape_the_root(tmp_path, name_a, name_b):
    root = tmp_path / "root"
    t = keys_for(1)
    with Rig([fs_tier(root)], ns=namespace(model=name_a)) as a:
        a.store(t, fill=0x0A)
    with Rig([fs_tier(root)], ns=namespace(model=name_b)) as b:
        assert b.resolve(t) == [MISS]
        b.store(t, fill=0x0B)
    files = files_under(tmp_path)
    assert len(files) == 2
    for f in files:
        assert os.path.realpath(f).startswith(str(root.resolve()) + os.sep)
        rel = os.path.relpath(f, root)
        assert os.fsencode(rel).decode("utf-8") == rel  # valid UTF-8 path components
        assert re.fullmatch(r"[0-9a-f]{32}/[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]+\.kv", rel), rel
    for name, value in ((name_a, 0x0A), (name_b, 0x0B)):
        with Rig([fs_tier(root)], ns=namespace(model=name)) as r:
            rows = read_back(r, t)
            assert rows is not None and (rows[0] == value).all()


_C05_PROC = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[3])
    import numpy as np
    from helpers import Rig, fs_tier, namespace, HIT
    from kvoffload.namespace import chunk_keys
    keys = chunk_keys(np.arange(64), 16)
    print(" ".join(k.hex() for k in keys), flush=True)
    with Rig([fs_tier(sys.argv[2])], ns=namespace(model="m")) as rig:
        if sys.argv[1] == "store":
            rig.store(keys)
            print("stored")
        else:
            res = rig.resolve(keys)
            print(sum(r is HIT for r in res))
""")


def test_c05_chunk_keys_do_not_depend_on_a_per_process_seed(tmp_path):
    here = TESTS_DIR
    env1 = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env2 = dict(env1, PYTHONHASHSEED="12345")
    p1 = subprocess.run(
        [sys.executable, "-c", _C05_PROC, "store", str(tmp_path), here],
        env=env1,
        capture_output=True,
        text=True,
        timeout=60,
    )
    p2 = subprocess.run(
        [sys.executable, "-c", _C05_PROC, "lookup", str(tmp_path), here],
        env=env2,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p1.returncode == 0 and p2.returncode == 0, p1.stderr + p2.stderr
    keys1, keys2 = p1.stdout.splitlines()[0], p2.stdout.splitlines()[0]
    assert keys1 == keys2
    assert p2.stdout.splitlines()[1] == "4"
    assert keys1.split()[0] == chunk_keys(np.arange(64), 16)[0].hex()
