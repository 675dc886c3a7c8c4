"""The fault-reintroducing patches of ``tox -e mutations`` (run by ``tests/mutations/run.py``).

Each entry is the smallest product change that brings a case's failure back (CASES.md in the shared
folder next to the checkout), and the case test(s) that must fail with it. ``old`` must occur exactly
once in ``file`` (a repository path); the runner refuses the whole list otherwise, so a patch that no
longer applies after a refactoring is noticed instead of silently passing.

To add one: append a ``Mutation(...)``; check it with
``python tests/mutations/run.py --case CNN`` (it first runs the named tests unpatched, then patched).

C18 (the shared location index of the p2p tier) has no entry: the p2p tier is not built yet
(DESIGN.md), so there is no code that could regress and no test for it.
"""

from __future__ import annotations

from typing import NamedTuple


class Mutation(NamedTuple):
    case: str  # "C08"
    name: str  # what the patch breaks, unique
    file: str  # repository path of the patched file
    old: str  # exact text, found exactly once
    new: str  # its replacement
    tests: tuple[str, ...]  # pytest node ids that must fail


NS = "tests/test_namespace.py::"
FS = "tests/test_fs_tier.py::"
OBJ = "tests/test_obj_tier.py::"
POL = "tests/test_policies.py::"
ARENA = "tests/test_arena.py::"
OBS = "tests/test_observability.py::"
CFG = "tests/test_config.py::"
SPEC = "tests/test_vllm_spec.py::"
WB = "tests/test_wrong_bytes.py::"
WC = "tests/test_worker_containment.py::"
CAP = "tests/test_fs_capacity.py::"
EV = "tests/test_event_content.py::"
XTP = "tests/test_cross_tp.py::"
BP = "tests/test_backpressure.py::"
OPS = "tests/test_ops_commands.py::"

_ID = "        return xxhash.xxh3_128_digest(msgspec.json.encode(self))"


def _drop_field(field: str, value: str = "None") -> str:
    return (
        "        return xxhash.xxh3_128_digest(msgspec.json.encode(\n"
        f"            msgspec.structs.replace(self, {field}={value})))"
    )


MUTATIONS: list[Mutation] = [
    # -- C01-C05: cache identity, path encoding, key determinism ---------------------------------
    Mutation(
        "C01",
        "kv dtype left out of the namespace id",
        "kvoffload/namespace.py",
        "        return xxhash.xxh3_128_digest(msgspec.json.encode(self))\n",
        (
            "        return xxhash.xxh3_128_digest(\n"
            '            msgspec.json.encode(msgspec.structs.replace(self, kv_dtype=""))\n'
            "        )\n"
        ),
        (NS + "test_c01_kv_dtype_is_part_of_the_identity",),
    ),
    Mutation(
        "C02",
        "model revision left out of the namespace id",
        "kvoffload/namespace.py",
        "        return xxhash.xxh3_128_digest(msgspec.json.encode(self))\n",
        (
            "        return xxhash.xxh3_128_digest(\n"
            "            msgspec.json.encode(msgspec.structs.replace(self, revision=None))\n"
            "        )\n"
        ),
        (NS + "test_c02_model_revision_and_local_path_are_part_of_the_identity",),
    ),
    Mutation(
        "C02",
        "local model path left out of the namespace id",
        "kvoffload/namespace.py",
        "        return xxhash.xxh3_128_digest(msgspec.json.encode(self))\n",
        (
            "        return xxhash.xxh3_128_digest(\n"
            "            msgspec.json.encode(msgspec.structs.replace(self, model_path=None))\n"
            "        )\n"
        ),
        (NS + "test_c02_model_revision_and_local_path_are_part_of_the_identity",),
    ),
    Mutation(
        "C03",
        "tensor-parallel rank left out of the namespace id",
        "kvoffload/namespace.py",
        "        return xxhash.xxh3_128_digest(msgspec.json.encode(self))\n",
        (
            "        return xxhash.xxh3_128_digest(\n"
            "            msgspec.json.encode(msgspec.structs.replace(self, tp_rank=None))\n"
            "        )\n"
        ),
        (NS + "test_c03_tensor_parallel_rank_is_part_of_the_identity",),
    ),
    Mutation(
        "C04",
        "lossy model-name encoding ('/' becomes '_')",
        "kvoffload/namespace.py",
        "        return xxhash.xxh3_128_digest(msgspec.json.encode(self))\n",
        (
            "        return xxhash.xxh3_128_digest(\n"
            '            msgspec.json.encode(msgspec.structs.replace(self, model=self.model.replace("/", "_")))\n'
            "        )\n"
        ),
        (NS + "test_c04_model_names_never_collide_or_escape_the_root",),
    ),
    Mutation(
        "C04",
        "model names normalized to NFC",
        "kvoffload/namespace.py",
        "        return xxhash.xxh3_128_digest(msgspec.json.encode(self))\n",
        (
            "        return xxhash.xxh3_128_digest(\n"
            "            msgspec.json.encode(\n"
            "                msgspec.structs.replace(\n"
            '                    self, model=__import__("unicodedata").normalize("NFC", self.model)\n'
            "                )\n"
            "            )\n"
            "        )\n"
        ),
        (NS + "test_c04_model_names_never_collide_or_escape_the_root",),
    ),
    Mutation(
        "C05",
        "chunk-key root seeded by the process's hash()",
        "kvoffload/namespace.py",
        '_KEY_ROOT = xxhash.xxh3_128_digest(b"kvoffload/chunk-key/v1")\n',
        '_KEY_ROOT = xxhash.xxh3_128_digest(b"kvoffload/chunk-key/v1" + str(hash("kvoffload")).encode())\n',
        (NS + "test_c05_chunk_keys_do_not_depend_on_a_per_process_seed",),
    ),
    # -- C06-C10: integrity and failure propagation ---------------------------------------------
    Mutation(
        "C06",
        "payload checksum not verified on load",
        "workers/fs_io.py",
        "        if cf.payload_checksum(dst) != checksum:\n",
        "        if False:\n",
        (FS + "test_c06_same_length_corruption_is_a_miss_and_the_file_is_removed",),
    ),
    Mutation(
        "C06",
        "task deadline never enforced",
        "kvoffload/workerpool.py",
        "                if now > head.deadline:\n",
        "                if False:\n",
        (FS + "test_c06_hung_read_fails_within_the_deadline_and_other_loads_complete",),
    ),
    Mutation(
        "C07",
        "a failed load leaves the key's verdict as it was",
        "kvoffload/tiers/process.py",
        "                self._mark_absent(k, self.config.failed_load_ttl_s)\n",
        "",
        (FS + "test_c07_failed_load_does_not_livelock_the_request",),
    ),
    Mutation(
        "C07",
        "a transient read error deletes the file",
        "workers/fs_io.py",
        (
            "                    continue\n"
            '                return IOOutcome(m.IO_ERROR, 0, f"read {key.hex()[:16]}: {e}")\n'
        ),
        (
            "                    continue\n"
            "                self._remove_corrupt(path, fd)\n"
            '                return IOOutcome(m.IO_ERROR, 0, f"read {key.hex()[:16]}: {e}")\n'
        ),
        (FS + "test_c07_failed_load_does_not_livelock_the_request",),
    ),
    Mutation(
        "C08",
        "the index entry of a missing file is kept",
        "kvoffload/tiers/fs.py",
        "            elif code in (m.MISSING, m.CORRUPT) and key in index:\n",
        "            elif code == m.CORRUPT and key in index:\n",
        (FS + "test_c08_file_deleted_outside_the_library_is_a_clean_miss",),
    ),
    Mutation(
        "C08",
        "a missing file is reported as an I/O error",
        "workers/fs_io.py",
        '                return IOOutcome(m.MISSING, 0, f"{key.hex()[:16]}: missing")\n',
        '                return IOOutcome(m.IO_ERROR, 0, f"{key.hex()[:16]}: missing")\n',
        (FS + "test_c08_file_deleted_outside_the_library_is_a_clean_miss",),
    ),
    Mutation(
        "C09",
        "the HTTP status dropped from the job result",
        "kvoffload/tiers/process.py",
        "                status=dict(job.status),\n",
        "                status={},\n",
        (OBJ + "test_c09_s3_errors_are_never_swallowed",),
    ),
    Mutation(
        "C09",
        "a failed upload recorded as present",
        "kvoffload/tiers/process.py",
        "            self._mark_present_many(ok_keys)\n",
        "            self._mark_present_many(meta.keys)\n",
        (OBJ + "test_c09_s3_errors_are_never_swallowed",),
    ),
    Mutation(
        "C09",
        "throttling (503 SlowDown) not retried",
        "workers/obj_io.py",
        '        retries={"total_max_attempts": cfg.max_attempts, "mode": "standard"},\n',
        '        retries={"total_max_attempts": 1, "mode": "standard"},\n',
        (OBJ + "test_c09_s3_errors_are_never_swallowed",),
    ),
    Mutation(
        "C10",
        "a probe that raced an eviction makes the key present",
        "kvoffload/tiers/process.py",
        "                if code == m.OK and not self._removed_since(key, rec.t0):\n",
        "                if code == m.OK:\n",
        (FS + "test_c10_a_chunk_evicted_from_a_capped_tier_is_a_miss_while_its_delete_is_pending",),
    ),
    Mutation(
        "C10",
        "a store admitted while its chunk's delete is pending",
        "kvoffload/tiers/fs.py",
        "            if k in self._deleting:\n",
        "            if False:\n",
        (FS + "test_c10_a_chunk_evicted_from_a_capped_tier_is_a_miss_while_its_delete_is_pending",),
    ),
    # -- C11-C14: eviction, pins, capacity --------------------------------------------------------
    Mutation(
        "C11",
        "keys of the store batch not protected from eviction",
        "kvoffload/host.py",
        "            protected = {index[k] for k in keys if k in index}\n",
        "            protected = set()\n",
        (POL + "test_c11_store_batch_never_evicts_its_own_keys",),
    ),
    Mutation(
        "C12",
        "a host-tier lookup pins the chunk",
        "kvoffload/tiering.py",
        "            return _HIT if host.state[slot] == READY else _PENDING\n",
        (
            "            if host.state[slot] == READY:\n"
            "                host._pin_slot(slot)\n"
            "                return _HIT\n"
            "            return _PENDING\n"
        ),
        (POL + "test_c12_aborted_requests_leave_nothing_pinned_and_nothing_behind",),
    ),
    Mutation(
        "C12",
        "a finished request's bookkeeping is kept",
        "kvoffload/tiering.py",
        "        self._load_source.pop(req_id, None)\n",
        "        pass\n",
        (POL + "test_c12_aborted_requests_leave_nothing_pinned_and_nothing_behind",),
    ),
    Mutation(
        "C13",
        "a worker rewrites a chunk file that already exists",
        "workers/fs_io.py",
        "        if os.path.exists(final):\n",
        "        if False:\n",
        (FS + "test_c13_repeated_puts_of_a_resident_chunk_are_not_double_counted",),
    ),
    Mutation(
        "C13",
        "a repeated put of an indexed chunk is counted again",
        "kvoffload/tiers/fs.py",
        "                if key not in index and key not in removed:\n",
        "                if key not in removed:\n",
        (FS + "test_c13_repeated_puts_of_a_resident_chunk_are_not_double_counted",),
    ),
    Mutation(
        "C14",
        "chunks of earlier runs not counted",
        "kvoffload/tiers/fs.py",
        "            self.used_bytes += size\n",
        "",
        (FS + "test_c14_chunks_from_earlier_runs_are_adopted_and_counted",),
    ),
    Mutation(
        "C14",
        "orphaned temporary files never removed",
        "workers/fs_io.py",
        "    if now - mtime <= older_than_s:\n",
        "    if True:\n",
        (FS + "test_c14_chunks_from_earlier_runs_are_adopted_and_counted",),
    ),
    # -- C15-C17: lifecycles and liveness ---------------------------------------------------------
    Mutation(
        "C15",
        "a dead owner's segment is not reclaimed at start",
        "ipc/arena.py",
        "        _remove_if_stale(name)\n",
        "",
        (ARENA + "test_c15_instance_killed_with_its_workers_leaves_no_segment_behind",),
    ),
    Mutation(
        "C15",
        "the janitor leaves a dead owner's segment behind",
        "ipc/janitor.py",
        (
            "    from kvoffload.ipc.arena import unlink_if_orphaned\n"
            "\n"
            "    while _alive(pid, create_time):\n"
            "        time.sleep(_POLL_S)\n"
            "        if not _arena_present(name, nonce):\n"
            "            return 0\n"
            "    unlink_if_orphaned(name, nonce, wait_s=_OWNER_WAIT_S)\n"
        ),
        (
            "\n"
            "    while _alive(pid, create_time):\n"
            "        time.sleep(_POLL_S)\n"
            "        if not _arena_present(name, nonce):\n"
            "            return 0\n"
        ),
        (ARENA + "test_c15_shm_segment_of_sigkilled_owner_is_removed_by_its_janitor",),
    ),
    Mutation(
        "C16",
        "an expired pending load is not counted",
        "kvoffload/tiers/process.py",
        '                        if rec.kind == "load" and code == m.TIMEOUT:\n',
        "                        if False:\n",
        (FS + "test_c16_dropped_load_turns_pending_into_miss_after_the_deadline",),
    ),
    Mutation(
        "C16",
        "an orphaned store keeps its capacity reservation",
        "kvoffload/tiers/fs.py",
        "            nbytes = self._reserved.pop(key, None)\n",
        "            nbytes = self._reserved.get(key)\n",
        (FS + "test_c16_dropped_store_releases_its_reservation_after_the_deadline",),
    ),
    Mutation(
        "C16",
        "a timed-out store's host pins are kept",
        "kvoffload/tiering.py",
        "                    host.unpin_slots(meta.slots)\n",
        "",
        (FS + "test_c16_dropped_store_releases_its_reservation_after_the_deadline",),
    ),
    Mutation(
        "C17",
        "a failed store published",
        "kvoffload/tiers/process.py",
        "            self._mark_present_many(ok_keys)\n",
        "            self._mark_present_many(meta.keys)\n",
        (FS + "test_c17_worker_that_dies_or_goes_silent_fails_or_reruns_its_jobs",),
    ),
    Mutation(
        "C17",
        "a late reply from a replaced worker accepted",
        "kvoffload/workerpool.py",
        "            return None\n",
        (
            "            w = next((x for x in self._by_wid.values() if task_id in x.inflight), None)\n"
            "            if w is None:\n"
            "                return None\n"
        ),
        (FS + "test_c17_worker_that_dies_or_goes_silent_fails_or_reruns_its_jobs",),
    ),
    Mutation(
        "C17",
        "a dead worker's tasks neither re-run nor failed",
        "kvoffload/workerpool.py",
        "                self.queue.extendleft(reversed(rerun))  # first in line, in their original order\n",
        "",
        (FS + "test_c17_worker_that_dies_or_goes_silent_fails_or_reruns_its_jobs",),
    ),
    # -- C19-C23: metrics, events, config, buffer lifetime, performance ---------------------------
    Mutation(
        "C19",
        "requested chunks counted only when they hit",
        "kvoffload/tiering.py",
        '            m.set_total("kvoffload_lookup_requested_chunks", st.host_queries)\n',
        '            m.set_total("kvoffload_lookup_requested_chunks", st.host_hits + sum(tier_hits.values()))\n',
        (OBS + "test_c19_hit_rate_counts_every_lookup_not_only_hits",),
    ),
    Mutation(
        "C20",
        "no event for copies stored in a secondary tier",
        "kvoffload/tiers/process.py",
        (
            "            if ok_keys and self.record_events:\n"
            "                self._events.append(TierEvent(list(ok_keys), False))\n"
        ),
        "            pass\n",
        (OBS + "test_c20_offloaded_copies_emit_kv_events",),
    ),
    Mutation(
        "C20",
        "an event emitted for a failed tier store",
        "kvoffload/tiers/process.py",
        "                self._events.append(TierEvent(list(ok_keys), False))\n",
        "                self._events.append(TierEvent(list(meta.keys), False))\n",
        (OBS + "test_c20_offloaded_copies_emit_kv_events",),
    ),
    Mutation(
        "C21",
        "a tier capacity accepted but not enforced",
        "kvoffload/tiers/fs.py",
        (
            "        self._index: OrderedDict[bytes, int] | None = (\n"
            "            OrderedDict() if self.max_bytes is not None else None\n"
            "        )\n"
        ),
        "        self._index: OrderedDict[bytes, int] | None = None\n",
        (FS + "test_c21_capacity_setting_is_enforced",),
    ),
    Mutation(
        "C21",
        "no near-miss suggestion for a misspelled tier key",
        "kvoffload/config.py",
        (
            "import difflib\n"
            "import importlib\n"
            "import re\n"
            "from typing import Annotated, Any\n"
            "\n"
            "import msgspec\n"
            "\n"
            "Positive = Annotated[int, msgspec.Meta(gt=0, le=2**63 - 1)]\n"
            "NonNegative = Annotated[int, msgspec.Meta(ge=0)]\n"
            "PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]\n"
            "\n"
            "\n"
            "class ConfigError(ValueError):\n"
            '    """Invalid configuration; the message names the offending key path."""\n'
            "\n"
            "\n"
            "class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):\n"
            '    """KV events on a ZMQ PUB socket (``kv_events`` in ``kv_connector_extra_config``).\n'
            "\n"
            "    Attributes:\n"
            "        endpoint: ZMQ endpoint the PUB socket binds (``tcp://*:5557``; port 0 picks one).\n"
            "        replay_endpoint: ROUTER endpoint serving recent batches to late subscribers (None: off).\n"
            "        topic: topic of vLLM-format ``KVEventBatch`` messages (``BlockStored`` / ``BlockRemoved``).\n"
            "        movements_topic: topic of chunk-movement batches (key, source, destination, locality).\n"
            "            Neither topic may be a prefix of the other (a ZMQ subscription matches by prefix).\n"
            "        buffer_steps: batches kept per topic for replay.\n"
            "        hwm: the PUB socket's send high-water mark (messages); beyond it ZMQ drops.\n"
            '    """\n'
            "\n"
            '    endpoint: str = "tcp://*:5557"\n'
            "    replay_endpoint: str | None = None\n"
            '    topic: str = "kv-events"\n'
            '    movements_topic: str = "kvoffload-movements"\n'
            "    buffer_steps: Positive = 10_000\n"
            "    hwm: Positive = 100_000\n"
            "\n"
            "\n"
            "class OffloadConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):\n"
            '    """Top-level settings (``kv_connector_extra_config``).\n'
            "\n"
            "    Attributes:\n"
            "        cpu_bytes_to_use: host-tier (arena) size in bytes. Required.\n"
            "        blocks_per_chunk: engine blocks per chunk (default 1). Read by vLLM too.\n"
            "        block_size: tokens per chunk instead of ``blocks_per_chunk`` (a multiple of the engine\n"
            "            block size). Read by vLLM too.\n"
            "        eviction_policy: ``lru`` or ``arc``, or an out-of-tree policy class name.\n"
            "        cache_policy_module_path: module of an out-of-tree eviction policy.\n"
            '        secondary_tiers: ordered list of tier configs (``{"type": "fs", ...}``); lookups ask them\n'
            "            in this order, stores go to all of them.\n"
            "        arena_name: fixed /dev/shm name for the host arena (default: derived from the engine id).\n"
            "        cache_salt: part of the namespace: instances with different salts never share chunks.\n"
            "        model_revision: model revision for the namespace when the engine does not report one.\n"
            "        offload_prompt_only: offload prompt blocks only (vLLM's setting, default True).\n"
            "        tier_pin_fraction: at most this fraction of the host slots may be pinned by one secondary\n"
            "            tier's in-flight stores (write-through); beyond it, that tier's stores are dropped and\n"
            "            counted (``kvoffload_dropped_stores``), so a slow tier cannot pin the whole host tier\n"
            "            and starve new stores (CASES C37). Default 0.5, chosen by measurement (BENCHMARKS.md\n"
            "            \u00a77); 1.0 lets one slow tier pin every host slot.\n"
            "        canonical_layout: store rows in vLLM's canonical (parallelism-free) layout.\n"
            "        self_describing_kv_events: vLLM's own KV events for offloaded chunks carry the request's\n"
            "            parent hash and token ids (vLLM's tracker; default on here, off in vLLM's own spec).\n"
            "        kv_events: publish KV events and chunk movements on a ZMQ PUB socket (see\n"
            "            :class:`KVEventsConfig`; None: off). Independent of vLLM's own ``--kv-events-config``.\n"
            "        instance_id: the ``instance`` label of standalone metrics and movement events (default:\n"
            "            process id and a counter).\n"
            "        spec_name, spec_module_path: how vLLM found this spec.\n"
            "        lock, config_info, expedited: accepted for vLLM 0.33 compatibility; unused.\n"
            "        sync_load_budget_bytes: read by vLLM's offloading scheduler (0.33), whatever the spec.\n"
            "        tier_poll_interval_s, backpressure, store_threshold, max_tracker_size: settings of vLLM's\n"
            "            own ``TieringOffloadingSpec`` / ``CPUOffloadingSpec``, accepted so that a config\n"
            "            written for it works unchanged; they have no effect here (logged once at start, see\n"
            "            :func:`ineffective_vllm_keys`). ``store_threshold`` above 1 is refused, as vLLM's\n"
            "            tiering spec refuses it.\n"
            '    """\n'
            "\n"
            "    cpu_bytes_to_use: Positive\n"
            "    blocks_per_chunk: Positive | None = None\n"
            "    block_size: Positive | None = None\n"
            '    eviction_policy: str = "lru"\n'
            "    cache_policy_module_path: str | None = None\n"
            "    secondary_tiers: list[dict[str, Any]] = []\n"
            '    arena_name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,200}$")] | None = None\n'
            '    cache_salt: str = ""\n'
            "    model_revision: str | None = None\n"
            "    offload_prompt_only: bool = True\n"
            "    tier_pin_fraction: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.5\n"
            "    canonical_layout: bool = False\n"
            "    self_describing_kv_events: bool = True\n"
            "    kv_events: KVEventsConfig | None = None\n"
            "    instance_id: str | None = None\n"
            '    spec_name: str = "KVOffloadSpec"\n'
            '    spec_module_path: str = "kvoffload.vllm"\n'
            "    lock: Any = None\n"
            "    config_info: Any = None\n"
            "    expedited: Any = None\n"
            "    sync_load_budget_bytes: NonNegative = 0\n"
            "    tier_poll_interval_s: float | None = None\n"
            "    backpressure: dict[str, Any] | None = None\n"
            "    store_threshold: Annotated[int, msgspec.Meta(ge=0, le=1)] = 0\n"
            "    max_tracker_size: Positive | None = None\n"
            "\n"
            "\n"
            "# Keys of vLLM's own tiering spec that kvoffload accepts (so a config written for it works after\n"
            "# changing only spec_name / spec_module_path) but does not act on, with what does that job here.\n"
            "VLLM_ONLY_KEYS = {\n"
            '    "tier_poll_interval_s": "tier workers report over sockets drained at every scheduler step",\n'
            '    "backpressure": "see tier_pin_fraction, and the tiers\' max_pending_store_chunks and "\n'
            '    "breaker_failures",\n'
            '    "max_tracker_size": "kvoffload offloads every stored chunk (store_threshold 0)",\n'
            "}\n"
            "VLLM_ONLY_TIER_KEYS = {\n"
            '    "backpressure": "see the tier\'s max_pending_store_chunks and breaker_failures, and "\n'
            '    "tier_pin_fraction",\n'
            '    "enable_kv_events": "kvoffload reports every tier in KV events whenever events are on",\n'
            "}\n"
            "\n"
            "\n"
            '_PATH_RE = re.compile(r"`\\$(?P<path>[^`]*)`")\n'
            '_UNKNOWN_RE = re.compile(r"unknown field `(?P<field>[^`]+)`")\n'
            "\n"
            "\n"
            "def closest(word: str, candidates: list[str]) -> str | None:\n"
            '    """The candidate a misspelled or truncated ``word`` most likely meant, or None."""\n'
            "    lowered = {c.lower(): c for c in candidates}\n"
            "    if word.lower() in lowered:\n"
            "        return lowered[word.lower()]\n"
            "    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)\n"
        ),
        (
            "import importlib\n"
            "import re\n"
            "from typing import Annotated, Any\n"
            "\n"
            "import msgspec\n"
            "\n"
            "Positive = Annotated[int, msgspec.Meta(gt=0, le=2**63 - 1)]\n"
            "NonNegative = Annotated[int, msgspec.Meta(ge=0)]\n"
            "PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]\n"
            "\n"
            "\n"
            "class ConfigError(ValueError):\n"
            '    """Invalid configuration; the message names the offending key path."""\n'
            "\n"
            "\n"
            "class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):\n"
            '    """KV events on a ZMQ PUB socket (``kv_events`` in ``kv_connector_extra_config``).\n'
            "\n"
            "    Attributes:\n"
            "        endpoint: ZMQ endpoint the PUB socket binds (``tcp://*:5557``; port 0 picks one).\n"
            "        replay_endpoint: ROUTER endpoint serving recent batches to late subscribers (None: off).\n"
            "        topic: topic of vLLM-format ``KVEventBatch`` messages (``BlockStored`` / ``BlockRemoved``).\n"
            "        movements_topic: topic of chunk-movement batches (key, source, destination, locality).\n"
            "            Neither topic may be a prefix of the other (a ZMQ subscription matches by prefix).\n"
            "        buffer_steps: batches kept per topic for replay.\n"
            "        hwm: the PUB socket's send high-water mark (messages); beyond it ZMQ drops.\n"
            '    """\n'
            "\n"
            '    endpoint: str = "tcp://*:5557"\n'
            "    replay_endpoint: str | None = None\n"
            '    topic: str = "kv-events"\n'
            '    movements_topic: str = "kvoffload-movements"\n'
            "    buffer_steps: Positive = 10_000\n"
            "    hwm: Positive = 100_000\n"
            "\n"
            "\n"
            "class OffloadConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):\n"
            '    """Top-level settings (``kv_connector_extra_config``).\n'
            "\n"
            "    Attributes:\n"
            "        cpu_bytes_to_use: host-tier (arena) size in bytes. Required.\n"
            "        blocks_per_chunk: engine blocks per chunk (default 1). Read by vLLM too.\n"
            "        block_size: tokens per chunk instead of ``blocks_per_chunk`` (a multiple of the engine\n"
            "            block size). Read by vLLM too.\n"
            "        eviction_policy: ``lru`` or ``arc``, or an out-of-tree policy class name.\n"
            "        cache_policy_module_path: module of an out-of-tree eviction policy.\n"
            '        secondary_tiers: ordered list of tier configs (``{"type": "fs", ...}``); lookups ask them\n'
            "            in this order, stores go to all of them.\n"
            "        arena_name: fixed /dev/shm name for the host arena (default: derived from the engine id).\n"
            "        cache_salt: part of the namespace: instances with different salts never share chunks.\n"
            "        model_revision: model revision for the namespace when the engine does not report one.\n"
            "        offload_prompt_only: offload prompt blocks only (vLLM's setting, default True).\n"
            "        tier_pin_fraction: at most this fraction of the host slots may be pinned by one secondary\n"
            "            tier's in-flight stores (write-through); beyond it, that tier's stores are dropped and\n"
            "            counted (``kvoffload_dropped_stores``), so a slow tier cannot pin the whole host tier\n"
            "            and starve new stores (CASES C37). Default 0.5, chosen by measurement (BENCHMARKS.md\n"
            "            \u00a77); 1.0 lets one slow tier pin every host slot.\n"
            "        canonical_layout: store rows in vLLM's canonical (parallelism-free) layout.\n"
            "        self_describing_kv_events: vLLM's own KV events for offloaded chunks carry the request's\n"
            "            parent hash and token ids (vLLM's tracker; default on here, off in vLLM's own spec).\n"
            "        kv_events: publish KV events and chunk movements on a ZMQ PUB socket (see\n"
            "            :class:`KVEventsConfig`; None: off). Independent of vLLM's own ``--kv-events-config``.\n"
            "        instance_id: the ``instance`` label of standalone metrics and movement events (default:\n"
            "            process id and a counter).\n"
            "        spec_name, spec_module_path: how vLLM found this spec.\n"
            "        lock, config_info, expedited: accepted for vLLM 0.33 compatibility; unused.\n"
            "        sync_load_budget_bytes: read by vLLM's offloading scheduler (0.33), whatever the spec.\n"
            "        tier_poll_interval_s, backpressure, store_threshold, max_tracker_size: settings of vLLM's\n"
            "            own ``TieringOffloadingSpec`` / ``CPUOffloadingSpec``, accepted so that a config\n"
            "            written for it works unchanged; they have no effect here (logged once at start, see\n"
            "            :func:`ineffective_vllm_keys`). ``store_threshold`` above 1 is refused, as vLLM's\n"
            "            tiering spec refuses it.\n"
            '    """\n'
            "\n"
            "    cpu_bytes_to_use: Positive\n"
            "    blocks_per_chunk: Positive | None = None\n"
            "    block_size: Positive | None = None\n"
            '    eviction_policy: str = "lru"\n'
            "    cache_policy_module_path: str | None = None\n"
            "    secondary_tiers: list[dict[str, Any]] = []\n"
            '    arena_name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,200}$")] | None = None\n'
            '    cache_salt: str = ""\n'
            "    model_revision: str | None = None\n"
            "    offload_prompt_only: bool = True\n"
            "    tier_pin_fraction: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.5\n"
            "    canonical_layout: bool = False\n"
            "    self_describing_kv_events: bool = True\n"
            "    kv_events: KVEventsConfig | None = None\n"
            "    instance_id: str | None = None\n"
            '    spec_name: str = "KVOffloadSpec"\n'
            '    spec_module_path: str = "kvoffload.vllm"\n'
            "    lock: Any = None\n"
            "    config_info: Any = None\n"
            "    expedited: Any = None\n"
            "    sync_load_budget_bytes: NonNegative = 0\n"
            "    tier_poll_interval_s: float | None = None\n"
            "    backpressure: dict[str, Any] | None = None\n"
            "    store_threshold: Annotated[int, msgspec.Meta(ge=0, le=1)] = 0\n"
            "    max_tracker_size: Positive | None = None\n"
            "\n"
            "\n"
            "# Keys of vLLM's own tiering spec that kvoffload accepts (so a config written for it works after\n"
            "# changing only spec_name / spec_module_path) but does not act on, with what does that job here.\n"
            "VLLM_ONLY_KEYS = {\n"
            '    "tier_poll_interval_s": "tier workers report over sockets drained at every scheduler step",\n'
            '    "backpressure": "see tier_pin_fraction, and the tiers\' max_pending_store_chunks and "\n'
            '    "breaker_failures",\n'
            '    "max_tracker_size": "kvoffload offloads every stored chunk (store_threshold 0)",\n'
            "}\n"
            "VLLM_ONLY_TIER_KEYS = {\n"
            '    "backpressure": "see the tier\'s max_pending_store_chunks and breaker_failures, and "\n'
            '    "tier_pin_fraction",\n'
            '    "enable_kv_events": "kvoffload reports every tier in KV events whenever events are on",\n'
            "}\n"
            "\n"
            "\n"
            '_PATH_RE = re.compile(r"`\\$(?P<path>[^`]*)`")\n'
            '_UNKNOWN_RE = re.compile(r"unknown field `(?P<field>[^`]+)`")\n'
            "\n"
            "\n"
            "def closest(word: str, candidates: list[str]) -> str | None:\n"
            '    """The candidate a misspelled or truncated ``word`` most likely meant, or None."""\n'
            "    lowered = {c.lower(): c for c in candidates}\n"
            "    if word.lower() in lowered:\n"
            "        return lowered[word.lower()]\n"
            "    close = []\n"
        ),
        (
            CFG + "test_c21_misspelled_tier_key_names_the_tier_path",
            CFG + "test_c21_misspelled_top_level_key_suggests_the_right_one",
        ),
    ),
    Mutation(
        "C21",
        "the resolved config not logged at start",
        "kvoffload/vllm.py",
        (
            "    describe,\n"
            "    ineffective_vllm_keys,\n"
            "    parse_config,\n"
            "    parse_tier_config,\n"
            ")\n"
            "from kvoffload.events import ChunkEventInfo\n"
            "from kvoffload.ipc.arena import Arena, default_name, round_up_to_page, sweep\n"
            "from kvoffload.namespace import GroupShape, Namespace, model_fingerprint\n"
            "from kvoffload.tiering import HOST, TieringManager\n"
            "from kvoffload.tiers.base import LookupResult as KVLookup\n"
            "from kvoffload.vllm_compat import (\n"
            "    CanonicalKVCaches,\n"
            "    CPULoadStoreSpec,\n"
            "    Locality,\n"
            "    LookupResult,\n"
            "    Medium,\n"
            "    OffloadingConfig,\n"
            "    OffloadingConnectorStats,\n"
            "    OffloadingEvent,\n"
            "    OffloadingKVEventsConfig,\n"
            "    OffloadingManager,\n"
            "    OffloadingSpec,\n"
            "    OffloadingWorker,\n"
            "    PrepareStoreOutput,\n"
            "    ReqContext,\n"
            "    RequestOffloadingContext,\n"
            "    calling_request,\n"
            "    convert_block_hash,\n"
            "    current_model_config,\n"
            "    drop_tolerated,\n"
            "    event_block_hash,\n"
            "    hit_source,\n"
            "    nondeterministic_block_hashes,\n"
            ")\n"
            "from kvoffload.vllm_worker import KVOffloadWorker\n"
            "\n"
            'log = logging.getLogger("kvoffload.vllm")\n'
            "_STATS_INTERVAL_S = 0.5\n"
            "_NOTED: set[str] = set()  # vLLM-only keys already logged in this process\n"
            "\n"
            "_TO_VLLM = {\n"
            "    KVLookup.HIT: LookupResult.HIT,\n"
            "    KVLookup.MISS: LookupResult.MISS,\n"
            "    KVLookup.HIT_PENDING: LookupResult.HIT_PENDING,\n"
            "    KVLookup.RETRY: LookupResult.RETRY,\n"
            "}\n"
            '_MEDIUM = {"CPU": Medium.CPU, "STORAGE": Medium.STORAGE}\n'
            '_LOCALITY = {"LOCAL": Locality.LOCAL, "REMOTE": Locality.REMOTE}\n'
            "\n"
            "\n"
            "def engine_namespace(\n"
            "    cfg: OffloadingConfig,\n"
            "    *,\n"
            "    layout: str,\n"
            "    blocks_per_chunk: int,\n"
            "    row_bytes: int,\n"
            "    model_revision: str | None,\n"
            "    cache_salt: str,\n"
            ") -> Namespace:\n"
            '    """The namespace of one vLLM engine\'s chunks (DESIGN.md \u00a74, "Keys and namespaces").\n'
            "\n"
            "    Args:\n"
            "        cfg: vLLM's ``OffloadingConfig`` (model, dtype, KV groups, parallel geometry).\n"
            "        layout: the row layout id (how bytes sit in a row), e.g. ``vllm-direct-v1:NHD``.\n"
            "        blocks_per_chunk: engine blocks per chunk.\n"
            "        row_bytes: bytes per chunk row.\n"
            "        model_revision: used when vLLM does not report the model's revision.\n"
            "        cache_salt: the ``cache_salt`` setting.\n"
            '    """\n'
            "    import os\n"
            "\n"
            "    mc = current_model_config()\n"
            '    revision = getattr(mc, "revision", None) or model_revision\n'
            "    model = cfg.model.name\n"
            "    path = os.path.realpath(model) if os.path.isdir(model) else None\n"
            "    agnostic = bool(cfg.canonical_layout) and cfg.parallel.is_parallelism_agnostic\n"
            "    # A canonical page holds every rank's heads: its size, not one worker's share, is the same\n"
            "    # under every geometry (CASES C35).\n"
            "    page_bytes = cfg.worker_kv_bytes_per_block * (\n"
            "        canonical_copies(cfg) if cfg.canonical_layout else 1\n"
            "    )\n"
            "    groups = tuple(\n"
            "        GroupShape(\n"
            "            tokens_per_block=g.tokens_per_block,\n"
            "            num_layers=len(g.layer_names),\n"
            "            page_bytes=page_bytes,\n"
            '            kind=f"group{g.group_id}",\n'
            "        )\n"
            "        for g in cfg.groups\n"
            "    )\n"
            "    par = cfg.parallel\n"
            "    return Namespace(\n"
            "        model=model,\n"
            "        revision=revision,\n"
            "        model_path=path,\n"
            "        model_fingerprint=model_fingerprint(path) if path else None,\n"
            "        kv_dtype=cfg.model.dtype,\n"
            "        layout=layout,\n"
            "        tokens_per_chunk=cfg.groups[0].tokens_per_block * blocks_per_chunk,\n"
            "        row_bytes=row_bytes,\n"
            "        groups=groups,\n"
            "        tp_size=None if agnostic else par.tp_size,\n"
            "        pp_size=None if agnostic else par.pp_size,\n"
            "        pcp_size=None if agnostic else par.pcp_size,\n"
            "        dcp_size=None if agnostic else par.dcp_size,\n"
            "        cache_salt=cache_salt,\n"
            "    )\n"
            "\n"
            "\n"
            "def canonical_copies(cfg: OffloadingConfig) -> int:\n"
            '    """How many workers\' pages of a block make one canonical page (vLLM\'s\n'
            "    ``CanonicalPageMapping.canonical_page_size_bytes`` / ``local_page_size_bytes``), known on the\n"
            "    scheduler side, before any worker has reported its mapping.\n"
            "\n"
            "    Attention KV is split by heads across TP ranks: ``min(tp_size, total KV heads)`` distinct head\n"
            "    shards (ranks beyond the head count hold replicas); an MLA latent is replicated on every rank\n"
            "    (one shard). Context parallelism splits a block's tokens over ``dcp_size * pcp_size`` ranks.\n"
            "    Without a model config in this process (standalone use) the head count is unknown and every\n"
            "    TP rank is taken to hold its own heads. The worker checks the figure against its mappings\n"
            "    (:class:`kvoffload.vllm_worker.KVOffloadWorker`) and refuses to start on a mismatch.\n"
            '    """\n'
            "    par = cfg.parallel\n"
            "    tp = max(par.tp_size, 1)\n"
            "    mc = current_model_config()\n"
            '    if cfg.replicated_layout or getattr(mc, "use_mla", False):\n'
            "        shards = 1\n"
            "    else:\n"
            "        shards = tp\n"
            "        try:\n"
            "            total_heads = int(mc.get_total_num_kv_heads()) if mc is not None else 0\n"
            "        except Exception:\n"
            "            total_heads = 0\n"
            "        if 0 < total_heads < tp:\n"
            "            shards = total_heads\n"
            "    return shards * max(par.dcp_size, 1) * max(par.pcp_size, 1)\n"
            "\n"
            "\n"
            "class KVOffloadSpec(OffloadingSpec):\n"
            '    """vLLM ``OffloadingSpec`` for kvoffload (see the module docstring for the config).\n'
            "\n"
            "    Raises (at construction, before any process or segment exists):\n"
            "        ConfigError: an invalid ``kv_connector_extra_config``, naming the key.\n"
            '    """\n'
            "\n"
            "    @classmethod\n"
            "    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:\n"
            '        """vLLM\'s metric hook (frontend process): every ``kvoffload_*`` metric, plus those the\n'
            "        configured tiers declare, so they appear on vLLM's ``/metrics``.\n"
            "\n"
            "        Raises:\n"
            "            ConfigError: the config is invalid (the same error the engine would raise).\n"
            '        """\n'
            "        cfg = parse_config(dict(extra_config))\n"
            "        defs = list(metrics.CORE_METRICS)\n"
            "        for i, raw in enumerate(cfg.secondary_tiers):\n"
            "            _, tier_cls, _ = parse_tier_config(\n"
            '                raw, f"kv_connector_extra_config.secondary_tiers[{i}]"\n'
            "            )\n"
            "            defs.extend(tier_cls.metric_definitions)\n"
            "        return metrics.vllm_metric_definitions(metrics.MetricSet(defs).defs.values())\n"
            "\n"
            "    def __init__(self, config: OffloadingConfig, *args: Any, **kwargs: Any):\n"
            "        drop_tolerated(kwargs)\n"
            "        logs.setup()\n"
            "        super().__init__(config)\n"
            "        self.settings: OffloadConfig = parse_config(dict(config.extra_config))\n"
            "        for note in ineffective_vllm_keys(dict(config.extra_config)):\n"
            "            if note not in _NOTED:\n"
            "                _NOTED.add(note)\n"
            "                log.warning(\n"
            '                    "kvoffload: kv_connector_extra_config.%s (a setting of vLLM\'s own "\n'
            '                    "tiering spec, accepted and not used here)",\n'
            "                    note,\n"
            "                )\n"
            "        s = self.settings\n"
            '        if OffloadingKVEventsConfig is not None and hasattr(self, "kv_events_config"):\n'
            "            # vLLM's own publisher: its tracker gives our CPU / STORAGE events the request's\n"
            "            # parent hash and token ids (kvoffload's default on; vLLM's spec default is off)\n"
            "            self.kv_events_config = OffloadingKVEventsConfig(\n"
            "                enable_kv_cache_events=self.kv_events_config.enable_kv_cache_events,\n"
            "                self_describing_kv_events=s.self_describing_kv_events,\n"
            "            )\n"
            "        par = config.parallel\n"
            "        self.replicated = bool(config.replicated_layout) and not config.canonical_layout\n"
            "        if config.canonical_layout:\n"
            "            # One canonical area holding every rank's heads: the same row under any TP size.\n"
            "            num_copies = canonical_copies(config)\n"
            "        else:\n"
            "            num_copies = 1 if self.replicated else max(par.world_size, 1)\n"
            "        self.canonical_copies = num_copies if config.canonical_layout else None\n"
            "        self.worker_page_bytes = config.worker_kv_bytes_per_block * self.blocks_per_chunk\n"
            "        self.row_bytes = (\n"
            "            round_up_to_page(self.worker_page_bytes * num_copies) if (self.worker_page_bytes) else 0\n"
            "        )\n"
            "        self.num_slots = s.cpu_bytes_to_use // self.row_bytes if self.row_bytes else 0\n"
            "        if self.row_bytes and self.num_slots == 0:\n"
            "            raise ConfigError(\n"
            '                f"kv_connector_extra_config.cpu_bytes_to_use: {s.cpu_bytes_to_use} bytes cannot hold "\n'
            '                f"one chunk of {self.row_bytes} bytes; raise it or lower blocks_per_chunk"\n'
            "            )\n"
            "        self.arena_name = s.arena_name or default_name(config.engine_id)\n"
            "        self._arena: Arena | None = None\n"
            "        self._manager: KVOffloadManager | None = None\n"
            "        self._worker: KVOffloadWorker | None = None\n"
            "\n"
            "    # -- identity -------------------------------------------------------------------------------\n"
            "\n"
            "    def namespace(self) -> Namespace:\n"
            '        """The namespace of this engine\'s chunks (model, revision, dtype, layout, geometry...)."""\n'
            '        layout = "vllm-canonical-v1" if self.config.canonical_layout else "vllm-direct-v1"\n'
            "        if self.config.kv_cache_layout:\n"
            '            layout += f":{self.config.kv_cache_layout}"\n'
            "        if self.replicated:\n"
            '            layout += ":replicated"\n'
            "        return engine_namespace(\n"
            "            self.config,\n"
            "            layout=layout,\n"
            "            blocks_per_chunk=self.blocks_per_chunk,\n"
            "            row_bytes=self.row_bytes,\n"
            "            model_revision=self.settings.model_revision,\n"
            "            cache_salt=self.settings.cache_salt,\n"
            "        )\n"
            "\n"
            "    def _open_arena(self) -> Arena:\n"
            "        if self._arena is None:\n"
            "            if self.num_slots == 0:\n"
            '                raise ConfigError("kvoffload: the engine reported no KV cache to offload")\n'
            "            self._arena = Arena.open_or_create(\n"
            "                self.arena_name, self.num_slots, self.row_bytes, self.config.engine_id\n"
            "            )\n"
            "        return self._arena\n"
            "\n"
            "    # -- vLLM interface -------------------------------------------------------------------------\n"
            "\n"
            "    def get_manager(self) -> OffloadingManager:\n"
            "        if self._manager is None:\n"
            "            reason = nondeterministic_block_hashes()\n"
            "            if reason and self.settings.secondary_tiers:\n"
            "                raise ConfigError(\n"
            '                    f"kvoffload: vLLM block hashes are not reproducible across processes ({reason}); "\n'
            '                    f"shared tiers would never hit. Set PYTHONHASHSEED or use the sha256 hash"\n'
            "                )\n"
            "            removed = sweep()\n"
            "            if removed:\n"
            "                log.info(\n"
            '                    "kvoffload: removed %d arena(s) of dead engines: %s", len(removed), removed\n'
            "                )\n"
            "            owned = self._arena is None\n"
            "            arena = self._open_arena()\n"
            '            log.info("kvoffload: %s", describe(self.settings))\n'
        ),
        (
            "    ineffective_vllm_keys,\n"
            "    parse_config,\n"
            "    parse_tier_config,\n"
            ")\n"
            "from kvoffload.events import ChunkEventInfo\n"
            "from kvoffload.ipc.arena import Arena, default_name, round_up_to_page, sweep\n"
            "from kvoffload.namespace import GroupShape, Namespace, model_fingerprint\n"
            "from kvoffload.tiering import HOST, TieringManager\n"
            "from kvoffload.tiers.base import LookupResult as KVLookup\n"
            "from kvoffload.vllm_compat import (\n"
            "    CanonicalKVCaches,\n"
            "    CPULoadStoreSpec,\n"
            "    Locality,\n"
            "    LookupResult,\n"
            "    Medium,\n"
            "    OffloadingConfig,\n"
            "    OffloadingConnectorStats,\n"
            "    OffloadingEvent,\n"
            "    OffloadingKVEventsConfig,\n"
            "    OffloadingManager,\n"
            "    OffloadingSpec,\n"
            "    OffloadingWorker,\n"
            "    PrepareStoreOutput,\n"
            "    ReqContext,\n"
            "    RequestOffloadingContext,\n"
            "    calling_request,\n"
            "    convert_block_hash,\n"
            "    current_model_config,\n"
            "    drop_tolerated,\n"
            "    event_block_hash,\n"
            "    hit_source,\n"
            "    nondeterministic_block_hashes,\n"
            ")\n"
            "from kvoffload.vllm_worker import KVOffloadWorker\n"
            "\n"
            'log = logging.getLogger("kvoffload.vllm")\n'
            "_STATS_INTERVAL_S = 0.5\n"
            "_NOTED: set[str] = set()  # vLLM-only keys already logged in this process\n"
            "\n"
            "_TO_VLLM = {\n"
            "    KVLookup.HIT: LookupResult.HIT,\n"
            "    KVLookup.MISS: LookupResult.MISS,\n"
            "    KVLookup.HIT_PENDING: LookupResult.HIT_PENDING,\n"
            "    KVLookup.RETRY: LookupResult.RETRY,\n"
            "}\n"
            '_MEDIUM = {"CPU": Medium.CPU, "STORAGE": Medium.STORAGE}\n'
            '_LOCALITY = {"LOCAL": Locality.LOCAL, "REMOTE": Locality.REMOTE}\n'
            "\n"
            "\n"
            "def engine_namespace(\n"
            "    cfg: OffloadingConfig,\n"
            "    *,\n"
            "    layout: str,\n"
            "    blocks_per_chunk: int,\n"
            "    row_bytes: int,\n"
            "    model_revision: str | None,\n"
            "    cache_salt: str,\n"
            ") -> Namespace:\n"
            '    """The namespace of one vLLM engine\'s chunks (DESIGN.md \u00a74, "Keys and namespaces").\n'
            "\n"
            "    Args:\n"
            "        cfg: vLLM's ``OffloadingConfig`` (model, dtype, KV groups, parallel geometry).\n"
            "        layout: the row layout id (how bytes sit in a row), e.g. ``vllm-direct-v1:NHD``.\n"
            "        blocks_per_chunk: engine blocks per chunk.\n"
            "        row_bytes: bytes per chunk row.\n"
            "        model_revision: used when vLLM does not report the model's revision.\n"
            "        cache_salt: the ``cache_salt`` setting.\n"
            '    """\n'
            "    import os\n"
            "\n"
            "    mc = current_model_config()\n"
            '    revision = getattr(mc, "revision", None) or model_revision\n'
            "    model = cfg.model.name\n"
            "    path = os.path.realpath(model) if os.path.isdir(model) else None\n"
            "    agnostic = bool(cfg.canonical_layout) and cfg.parallel.is_parallelism_agnostic\n"
            "    # A canonical page holds every rank's heads: its size, not one worker's share, is the same\n"
            "    # under every geometry (CASES C35).\n"
            "    page_bytes = cfg.worker_kv_bytes_per_block * (\n"
            "        canonical_copies(cfg) if cfg.canonical_layout else 1\n"
            "    )\n"
            "    groups = tuple(\n"
            "        GroupShape(\n"
            "            tokens_per_block=g.tokens_per_block,\n"
            "            num_layers=len(g.layer_names),\n"
            "            page_bytes=page_bytes,\n"
            '            kind=f"group{g.group_id}",\n'
            "        )\n"
            "        for g in cfg.groups\n"
            "    )\n"
            "    par = cfg.parallel\n"
            "    return Namespace(\n"
            "        model=model,\n"
            "        revision=revision,\n"
            "        model_path=path,\n"
            "        model_fingerprint=model_fingerprint(path) if path else None,\n"
            "        kv_dtype=cfg.model.dtype,\n"
            "        layout=layout,\n"
            "        tokens_per_chunk=cfg.groups[0].tokens_per_block * blocks_per_chunk,\n"
            "        row_bytes=row_bytes,\n"
            "        groups=groups,\n"
            "        tp_size=None if agnostic else par.tp_size,\n"
            "        pp_size=None if agnostic else par.pp_size,\n"
            "        pcp_size=None if agnostic else par.pcp_size,\n"
            "        dcp_size=None if agnostic else par.dcp_size,\n"
            "        cache_salt=cache_salt,\n"
            "    )\n"
            "\n"
            "\n"
            "def canonical_copies(cfg: OffloadingConfig) -> int:\n"
            '    """How many workers\' pages of a block make one canonical page (vLLM\'s\n'
            "    ``CanonicalPageMapping.canonical_page_size_bytes`` / ``local_page_size_bytes``), known on the\n"
            "    scheduler side, before any worker has reported its mapping.\n"
            "\n"
            "    Attention KV is split by heads across TP ranks: ``min(tp_size, total KV heads)`` distinct head\n"
            "    shards (ranks beyond the head count hold replicas); an MLA latent is replicated on every rank\n"
            "    (one shard). Context parallelism splits a block's tokens over ``dcp_size * pcp_size`` ranks.\n"
            "    Without a model config in this process (standalone use) the head count is unknown and every\n"
            "    TP rank is taken to hold its own heads. The worker checks the figure against its mappings\n"
            "    (:class:`kvoffload.vllm_worker.KVOffloadWorker`) and refuses to start on a mismatch.\n"
            '    """\n'
            "    par = cfg.parallel\n"
            "    tp = max(par.tp_size, 1)\n"
            "    mc = current_model_config()\n"
            '    if cfg.replicated_layout or getattr(mc, "use_mla", False):\n'
            "        shards = 1\n"
            "    else:\n"
            "        shards = tp\n"
            "        try:\n"
            "            total_heads = int(mc.get_total_num_kv_heads()) if mc is not None else 0\n"
            "        except Exception:\n"
            "            total_heads = 0\n"
            "        if 0 < total_heads < tp:\n"
            "            shards = total_heads\n"
            "    return shards * max(par.dcp_size, 1) * max(par.pcp_size, 1)\n"
            "\n"
            "\n"
            "class KVOffloadSpec(OffloadingSpec):\n"
            '    """vLLM ``OffloadingSpec`` for kvoffload (see the module docstring for the config).\n'
            "\n"
            "    Raises (at construction, before any process or segment exists):\n"
            "        ConfigError: an invalid ``kv_connector_extra_config``, naming the key.\n"
            '    """\n'
            "\n"
            "    @classmethod\n"
            "    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:\n"
            '        """vLLM\'s metric hook (frontend process): every ``kvoffload_*`` metric, plus those the\n'
            "        configured tiers declare, so they appear on vLLM's ``/metrics``.\n"
            "\n"
            "        Raises:\n"
            "            ConfigError: the config is invalid (the same error the engine would raise).\n"
            '        """\n'
            "        cfg = parse_config(dict(extra_config))\n"
            "        defs = list(metrics.CORE_METRICS)\n"
            "        for i, raw in enumerate(cfg.secondary_tiers):\n"
            "            _, tier_cls, _ = parse_tier_config(\n"
            '                raw, f"kv_connector_extra_config.secondary_tiers[{i}]"\n'
            "            )\n"
            "            defs.extend(tier_cls.metric_definitions)\n"
            "        return metrics.vllm_metric_definitions(metrics.MetricSet(defs).defs.values())\n"
            "\n"
            "    def __init__(self, config: OffloadingConfig, *args: Any, **kwargs: Any):\n"
            "        drop_tolerated(kwargs)\n"
            "        logs.setup()\n"
            "        super().__init__(config)\n"
            "        self.settings: OffloadConfig = parse_config(dict(config.extra_config))\n"
            "        for note in ineffective_vllm_keys(dict(config.extra_config)):\n"
            "            if note not in _NOTED:\n"
            "                _NOTED.add(note)\n"
            "                log.warning(\n"
            '                    "kvoffload: kv_connector_extra_config.%s (a setting of vLLM\'s own "\n'
            '                    "tiering spec, accepted and not used here)",\n'
            "                    note,\n"
            "                )\n"
            "        s = self.settings\n"
            '        if OffloadingKVEventsConfig is not None and hasattr(self, "kv_events_config"):\n'
            "            # vLLM's own publisher: its tracker gives our CPU / STORAGE events the request's\n"
            "            # parent hash and token ids (kvoffload's default on; vLLM's spec default is off)\n"
            "            self.kv_events_config = OffloadingKVEventsConfig(\n"
            "                enable_kv_cache_events=self.kv_events_config.enable_kv_cache_events,\n"
            "                self_describing_kv_events=s.self_describing_kv_events,\n"
            "            )\n"
            "        par = config.parallel\n"
            "        self.replicated = bool(config.replicated_layout) and not config.canonical_layout\n"
            "        if config.canonical_layout:\n"
            "            # One canonical area holding every rank's heads: the same row under any TP size.\n"
            "            num_copies = canonical_copies(config)\n"
            "        else:\n"
            "            num_copies = 1 if self.replicated else max(par.world_size, 1)\n"
            "        self.canonical_copies = num_copies if config.canonical_layout else None\n"
            "        self.worker_page_bytes = config.worker_kv_bytes_per_block * self.blocks_per_chunk\n"
            "        self.row_bytes = (\n"
            "            round_up_to_page(self.worker_page_bytes * num_copies) if (self.worker_page_bytes) else 0\n"
            "        )\n"
            "        self.num_slots = s.cpu_bytes_to_use // self.row_bytes if self.row_bytes else 0\n"
            "        if self.row_bytes and self.num_slots == 0:\n"
            "            raise ConfigError(\n"
            '                f"kv_connector_extra_config.cpu_bytes_to_use: {s.cpu_bytes_to_use} bytes cannot hold "\n'
            '                f"one chunk of {self.row_bytes} bytes; raise it or lower blocks_per_chunk"\n'
            "            )\n"
            "        self.arena_name = s.arena_name or default_name(config.engine_id)\n"
            "        self._arena: Arena | None = None\n"
            "        self._manager: KVOffloadManager | None = None\n"
            "        self._worker: KVOffloadWorker | None = None\n"
            "\n"
            "    # -- identity -------------------------------------------------------------------------------\n"
            "\n"
            "    def namespace(self) -> Namespace:\n"
            '        """The namespace of this engine\'s chunks (model, revision, dtype, layout, geometry...)."""\n'
            '        layout = "vllm-canonical-v1" if self.config.canonical_layout else "vllm-direct-v1"\n'
            "        if self.config.kv_cache_layout:\n"
            '            layout += f":{self.config.kv_cache_layout}"\n'
            "        if self.replicated:\n"
            '            layout += ":replicated"\n'
            "        return engine_namespace(\n"
            "            self.config,\n"
            "            layout=layout,\n"
            "            blocks_per_chunk=self.blocks_per_chunk,\n"
            "            row_bytes=self.row_bytes,\n"
            "            model_revision=self.settings.model_revision,\n"
            "            cache_salt=self.settings.cache_salt,\n"
            "        )\n"
            "\n"
            "    def _open_arena(self) -> Arena:\n"
            "        if self._arena is None:\n"
            "            if self.num_slots == 0:\n"
            '                raise ConfigError("kvoffload: the engine reported no KV cache to offload")\n'
            "            self._arena = Arena.open_or_create(\n"
            "                self.arena_name, self.num_slots, self.row_bytes, self.config.engine_id\n"
            "            )\n"
            "        return self._arena\n"
            "\n"
            "    # -- vLLM interface -------------------------------------------------------------------------\n"
            "\n"
            "    def get_manager(self) -> OffloadingManager:\n"
            "        if self._manager is None:\n"
            "            reason = nondeterministic_block_hashes()\n"
            "            if reason and self.settings.secondary_tiers:\n"
            "                raise ConfigError(\n"
            '                    f"kvoffload: vLLM block hashes are not reproducible across processes ({reason}); "\n'
            '                    f"shared tiers would never hit. Set PYTHONHASHSEED or use the sha256 hash"\n'
            "                )\n"
            "            removed = sweep()\n"
            "            if removed:\n"
            "                log.info(\n"
            '                    "kvoffload: removed %d arena(s) of dead engines: %s", len(removed), removed\n'
            "                )\n"
            "            owned = self._arena is None\n"
            "            arena = self._open_arena()\n"
        ),
        (SPEC + "test_c21_the_resolved_config_is_logged_once_at_start",),
    ),
    Mutation(
        "C22",
        "a store's source slot not pinned while the writer reads it",
        "kvoffload/tiering.py",
        "            slots = host.pin(take)\n",
        "            slots = [host.index[k] for k in take]\n",
        (FS + "test_c22_store_source_slot_is_not_reused_while_the_writer_reads_it",),
    ),
    Mutation(
        "C23",
        "a full, fully pinned host tier asks the policy anyway",
        "kvoffload/host.py",
        "            if need > self.num_evictable:\n                return None\n",
        "",
        (POL + "test_c23_full_tier_with_everything_pinned_answers_at_once",),
    ),
    Mutation(
        "C23",
        "the fs tier's directory fan-out removed",
        "workers/chunkfile.py",
        '    return f"{a}/{b}/{key.hex()}{SUFFIX}"\n',
        '    return f"{key.hex()}{SUFFIX}"\n',
        (FS + "test_c23_lookup_among_100k_chunk_files_fanned_out_over_directories",),
    ),
    # -- C24-C37: cases added after the first release was tried ------------------------------------
    Mutation(
        "C24",
        "a short worker reply counts its missing keys as success",
        "kvoffload/tiers/process.py",
        "        if len(codes) != n:\n",
        "        if len(codes) > n:\n",
        (WB + "test_c24_a_reply_that_does_not_confirm_every_key_never_publishes_it[reply_short]",),
    ),
    Mutation(
        "C24",
        "an unknown verdict code is taken as a failure code of its own",
        "kvoffload/tiers/process.py",
        "        if all(c in known for c in codes):\n",
        "        if True:\n",
        (
            WB + "test_c24_a_reply_that_does_not_confirm_every_key_never_publishes_it"
            "[reply_bad_code]",
        ),
    ),
    Mutation(
        "C24",
        "a reply for a task never sent is dropped without being counted",
        "kvoffload/tiers/process.py",
        '        self.count("unknown_replies")\n',
        "",
        (WB + "test_c24_a_reply_for_a_task_never_sent_is_dropped_and_counted",),
    ),
    Mutation(
        "C25",
        "a worker contains only I/O errors",
        "workers/main.py",
        (
            '            return IOOutcome(code, 0, f"{what} {key.hex()[:16]}: {e}")\n'
            "        except Exception as e:\n"
            '            self.errors.log(f"{what} {key.hex()[:16]}", e)\n'
        ),
        (
            '            return IOOutcome(code, 0, f"{what} {key.hex()[:16]}: {e}")\n'
            "        except OSError as e:\n"
            '            self.errors.log(f"{what} {key.hex()[:16]}", e)\n'
        ),
        (WC + "test_c25_an_injected_non_io_error_fails_its_key_and_the_worker_goes_on",),
    ),
    Mutation(
        "C26",
        "a reset frees slots with transfers in flight",
        "kvoffload/host.py",
        "            if state[slot] == WRITING or refs[slot] > 0:\n",
        "            if False:\n",
        (WB + "test_c26_reset_while_a_tier_load_is_in_flight_never_reuses_its_slot",),
    ),
    Mutation(
        "C27",
        "a reset drops the events queued before it",
        "kvoffload/host.py",
        (
            "        self.policy.clear()\n"
            "        if removed and self._events is not None:\n"
            "            self._events.append(TierEvent(removed, True))\n"
            "        return busy\n"
        ),
        (
            "        self.policy.clear()\n"
            "        if self._events is not None:\n"
            "            self._events = [TierEvent(removed, True)] if removed else []\n"
            "        return busy\n"
        ),
        (WB + "test_c27_events_queued_at_a_reset_are_published_and_the_reset_too",),
    ),
    Mutation(
        "C28",
        "a completion without a pin of its own drops the chunk's pin",
        "kvoffload/tiering.py",
        ("                self.stats.unheld_completions += 1\n                continue\n"),
        (
            "                self.stats.unheld_completions += 1\n"
            "                if k in host.index:\n"
            "                    host.unpin_slot(host.index[k])\n"
            "                continue\n"
        ),
        (WB + "test_c28_a_duplicated_completion_never_releases_another_requests_pin",),
    ),
    Mutation(
        "C28",
        "a store completion from another request ends a write",
        "kvoffload/tiering.py",
        "            if writes.get(k) == req_id:\n",
        "            if k in writes:\n",
        (WB + "test_a_stale_store_completion_never_ends_another_requests_write[True]",),
    ),
    Mutation(
        "C29",
        "temporary files removed whatever their age",
        "workers/fs_io.py",
        ("    if now - mtime <= older_than_s:\n        return False\n"),
        "",
        (
            OPS
            + "test_c29_a_fresh_temp_file_of_a_pid_unknown_here_survives_start_and_goes_once_old",
        ),
    ),
    Mutation(
        "C30",
        "every data-parallel rank binds the same event port",
        "kvoffload/events.py",
        '    return endpoint if int(port) == 0 else f"{host}:{int(port) + data_parallel_rank}"\n',
        "    return endpoint\n",
        (EV + "test_c30_a_second_data_parallel_rank_starts_with_kv_events_on",),
    ),
    Mutation(
        "C31",
        "the refused O_DIRECT attempt's file is left for the buffered retry",
        "workers/fs_io.py",
        '                self._direct_refused("writes", "the open", e, leftover=tmp)\n',
        '                self._direct_refused("writes", "the open", e)\n',
        (
            WC + "test_c31_a_filesystem_refusing_direct_io_half_way_stores_everything_buffered"
            "[direct_open_created]",
        ),
    ),
    Mutation(
        "C32",
        "a chunk file whose removal failed is forgotten",
        "kvoffload/tiers/fs.py",
        "            index[k] = nbytes\n",
        "            pass\n",
        (CAP + "test_c32_undeletable_chunk_file_stays_counted_and_the_next_lru_is_evicted[fault]",),
    ),
    Mutation(
        "C33",
        "a full disk does not lower the tier's cap",
        "kvoffload/tiers/fs.py",
        "            self._disk_full(full)\n",
        "            pass\n",
        (CAP + "test_c33_disk_full_before_the_cap_evicts_own_lru_chunks_and_stores_go_on",),
    ),
    Mutation(
        "C34",
        "stored-block events without parent hash and token ids",
        "kvoffload/tiering.py",
        (
            "                                parent_block_hash=info.parent_block_hash,\n"
            "                                token_ids=info.token_ids,\n"
        ),
        (
            "                                parent_block_hash=None,\n"
            "                                token_ids=[],\n"
        ),
        (EV + "test_c34_stored_block_events_carry_parent_hash_and_token_ids",),
    ),
    Mutation(
        "C35",
        "canonical rows sized from one rank's page",
        "kvoffload/vllm.py",
        "    return shards * max(par.dcp_size, 1) * max(par.pcp_size, 1)\n",
        "    return 1\n",
        (XTP + "test_c35_canonical_layout_is_shared_across_tensor_parallel_sizes",),
    ),
    Mutation(
        "C36",
        "a request waiting on a probe is not owed its MISS",
        "kvoffload/tiers/process.py",
        "        if owed is not None and req_id in owed:\n",
        "        if False:\n",
        (CAP + "test_c36_zero_negative_ttl_lookup_answers_miss_once_the_probe_answered",),
    ),
    Mutation(
        "C37",
        "one slow tier may pin every host slot by default",
        "kvoffload/config.py",
        "    tier_pin_fraction: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.5\n",
        "    tier_pin_fraction: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0\n",
        (BP + "test_c37_a_slow_tier_does_not_stop_the_host_tier_taking_new_chunks",),
    ),
]
