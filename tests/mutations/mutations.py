"""The fault-reintroducing patches of ``tox -e mutations`` (run by ``tests/mutations/run.py``).

Each entry is the smallest product change that brings a case's failure back (the cases are in
docs/cases.md), and the case test(s) that must fail with it. ``old`` must occur exactly once in
``file`` (a repository path); the runner refuses the whole list otherwise, so a patch that no longer
applies after a refactoring is noticed instead of silently passing.

To add one: append a ``Mutation(...)``, list its name under **Mutation:** in its case's entry in
docs/cases.md (tests/unit/test_cases_catalogue.py checks both), and check it with ``python
tests/mutations/run.py --case CNN`` (it first runs the named tests unpatched, then patched).

C18 (the shared location index of the p2p tier): its index is ``PeerLocations``
(``kvoffload/tiers/p2p/locations.py``), which learns from the peers' KV events.
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


NS = "tests/integration/test_namespace.py::"
FS = "tests/integration/test_fs_tier.py::"
OBJ = "tests/integration/test_obj_tier.py::"
POL = "tests/unit/test_policies.py::"
ARENA = "tests/integration/test_arena.py::"
OBS = "tests/integration/test_observability.py::"
CFG = "tests/unit/test_config.py::"
SPEC = "tests/integration/test_vllm_spec.py::"
WB = "tests/integration/test_wrong_bytes.py::"
WC = "tests/integration/test_worker_containment.py::"
P2PH = "tests/integration/test_p2p_host_access.py::"
RV = "tests/integration/test_router_view.py::"
CAP = "tests/integration/test_fs_capacity.py::"
EV = "tests/integration/test_event_content.py::"
P2PW = "tests/integration/test_p2p_worker.py::"
P2PT = "tests/integration/test_p2p_transport.py::"
P2PS = "tests/integration/test_p2p_server.py::"
P2PC = "tests/integration/test_p2p_client.py::"
TIER = "tests/integration/test_p2p_tier.py::"
XTP = "tests/integration/test_cross_tp.py::"
BP = "tests/integration/test_backpressure.py::"
OPS = "tests/integration/test_ops_commands.py::"
LOC = "tests/integration/test_p2p_locations.py::"
CO = "tests/integration/test_arena_cotenant.py::"
COT = "tests/integration/test_cotenant_fs.py::"
P2PS = "tests/integration/test_p2p_server.py::"
P2PC = "tests/integration/test_p2p_client.py::"
ATT = "tests/integration/test_p2p_attacks.py::"
BRK = "tests/unit/test_refusal_metrics.py::"
TRUTH = "tests/integration/test_counter_truth.py::"
CAPU = "tests/unit/test_capacity.py::"
ENC = "tests/integration/test_encryption.py::"
# files split between tests/unit, tests/integration and tests/netns by what their tests do
POL_RIG = "tests/integration/test_policies.py::"
ATT_NS = "tests/netns/test_p2p_attacks.py::"
WA = "tests/integration/test_warm_restart_attacks.py::"

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
        "C02",
        "vLLM's --revision left out of the engine's namespace",
        "kvoffload/vllm/spec.py",
        '    revision = getattr(model_config, "revision", None) or model_revision\n',
        "    revision = model_revision\n",
        (SPEC + "test_c02_the_scheduler_namespace_carries_vllms_model_revision",),
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
    Mutation(
        "C05",
        "the scheduler does not see the engine's prefix-hash algorithm",
        "kvoffload/vllm/spec.py",
        "            reason = nondeterministic_block_hashes(self.vllm_config)\n",
        "            reason = nondeterministic_block_hashes(None)\n",
        (SPEC + "test_c05_nondeterministic_block_hashes_with_a_shared_tier_fail_at_start",),
    ),
    # -- C06-C10: integrity and failure propagation ---------------------------------------------
    Mutation(
        "C06",
        "payload checksum not verified on load",
        "workers/fs_io.py",
        "        if cf.record_checksum(head, into) != checksum:\n",
        "        if False:\n",
        (FS + "test_c06_same_length_corruption_is_a_miss_and_the_file_is_removed",),
    ),
    Mutation(
        "C06",
        "an encrypted chunk's checksum leaves its salt, nonce and tag out",
        "workers/chunkfile.py",
        "    h = xxhash.xxh3_64(record)\n",
        "    h = xxhash.xxh3_64()\n",
        (
            ENC
            + "test_c06_damage_to_the_salt_nonce_or_tag_is_a_checksum_failure_not_a_forgery[fs]",
            ENC
            + "test_c06_damage_to_the_salt_nonce_or_tag_is_a_checksum_failure_not_a_forgery[obj]",
        ),
    ),
    Mutation(
        "C06",
        "task deadline never enforced",
        "kvoffload/tiers/workerpool.py",
        "                if now > head.deadline:\n",
        "                if False:\n",
        (FS + "test_c06_hung_read_fails_within_the_deadline_and_other_loads_complete",),
    ),
    Mutation(
        "C07",
        "a failed load leaves the key's verdict as it was",
        "kvoffload/tiers/process.py",
        "                self.verdicts.mark_absent(k, guessed if why == SPECULATIVE_MISS else ttl)\n",
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
            "                self._remove_bad(d, name, fd)\n"
            '                return IOOutcome(m.IO_ERROR, 0, f"read {key.hex()[:16]}: {e}")\n'
        ),
        (FS + "test_c07_failed_load_does_not_livelock_the_request",),
    ),
    Mutation(
        "C08",
        "the index entry of a missing file is kept",
        "kvoffload/tiers/capacity.py",
        "            if failed.get(key, m.OK) in (m.MISSING, m.CORRUPT, m.FORGED, m.UNSAFE_PATH):\n",
        "            if failed.get(key, m.OK) in (m.CORRUPT, m.FORGED, m.UNSAFE_PATH):\n",
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
        "            self.verdicts.mark_present(ok_keys)\n",
        "            self.verdicts.mark_present(meta.keys)\n",
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
        "            if code == m.OK and not self.capacity.removed_since(key, rec.t0):\n",
        "            if code == m.OK:\n",
        (FS + "test_c10_a_chunk_evicted_from_a_capped_tier_is_a_miss_while_its_delete_is_pending",),
    ),
    Mutation(
        "C10",
        "a store admitted while its chunk's delete is pending",
        "kvoffload/tiers/capacity.py",
        "            if k in self.deleting:\n",
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
        "                return _HIT if host.state[slot] == READY else _PENDING\n",
        (
            "                if host.state[slot] == READY:\n"
            "                    host._pin_slot(slot)\n"
            "                    return _HIT\n"
            "                return _PENDING\n"
        ),
        (POL_RIG + "test_c12_aborted_requests_leave_nothing_pinned_and_nothing_behind",),
    ),
    Mutation(
        "C12",
        "a finished request's bookkeeping is kept",
        "kvoffload/tiering.py",
        "            self._load_source.pop(req_id, None)\n",
        "            pass\n",
        (POL_RIG + "test_c12_aborted_requests_leave_nothing_pinned_and_nothing_behind",),
    ),
    Mutation(
        "C13",
        "a worker rewrites a chunk file that already exists",
        "workers/fs_io.py",
        "        if found is not None:\n",
        "        if False:\n",
        (FS + "test_c13_repeated_puts_of_a_resident_chunk_are_not_double_counted",),
    ),
    Mutation(
        "C13",
        "a repeated put of an indexed chunk is counted again",
        "kvoffload/tiers/capacity.py",
        "                if key not in index and key not in removed:\n",
        "                if key not in removed:\n",
        (FS + "test_c13_repeated_puts_of_a_resident_chunk_are_not_double_counted",),
    ),
    Mutation(
        "C14",
        "chunks of earlier runs not counted",
        "kvoffload/tiers/capacity.py",
        "            ident = self._count(key, size)\n",
        "            ident = self._count(key, 0)\n",
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
        # both reclaims of a start: before creating, and after a failed create when the header
        # does not read as a live engine's (warm restart's second look, C56)
        "        _remove_if_stale(name)\n        st = os.statvfs(SHM_DIR)\n        free = st.f_bavail * st.f_frsize\n        if total > free:\n            raise ArenaSpaceError(\n                f\"{size_hint_key}: the host arena needs {total / 2**30:.2f} GiB but {SHM_DIR} has \"\n                f\"{free / 2**30:.2f} GiB free; lower {size_hint_key} or enlarge {SHM_DIR}\"\n            )\n        try:\n            shm = posix_ipc.SharedMemory(pname, posix_ipc.O_CREX, mode=ARENA_MODE)\n        except posix_ipc.ExistentialError:\n            _refuse_foreign(name)\n            if table:\n                taken = cls._claim(name, num_slots, row_bytes, engine_id, keep_s, janitor)\n                if taken is not None:\n                    return taken\n                # the kept segment may have gone while we claimed it (its keeper's deadline) and\n                # another user's taken the name: that is refused as such, never reported busy\n                _refuse_foreign(name)\n                if not os.path.exists(os.path.join(SHM_DIR, name)):  # reclaimed: another shape\n                    return cls.create(\n                        name, num_slots, row_bytes, engine_id, size_hint_key, janitor, table, keep_s\n                    )\n            # not a live engine's by its header: the lock that kept it here may have been another\n            # process's look at it (a sweep, a listing), held for a moment; look again before\n            # failing the start\n            if not _live_engine(name) and _remove_if_stale(name, _PROBE_PATIENCE_S) is True:\n",
        "        st = os.statvfs(SHM_DIR)\n        free = st.f_bavail * st.f_frsize\n        if total > free:\n            raise ArenaSpaceError(\n                f\"{size_hint_key}: the host arena needs {total / 2**30:.2f} GiB but {SHM_DIR} has \"\n                f\"{free / 2**30:.2f} GiB free; lower {size_hint_key} or enlarge {SHM_DIR}\"\n            )\n        try:\n            shm = posix_ipc.SharedMemory(pname, posix_ipc.O_CREX, mode=ARENA_MODE)\n        except posix_ipc.ExistentialError:\n            _refuse_foreign(name)\n            if table:\n                taken = cls._claim(name, num_slots, row_bytes, engine_id, keep_s, janitor)\n                if taken is not None:\n                    return taken\n                # the kept segment may have gone while we claimed it (its keeper's deadline) and\n                # another user's taken the name: that is refused as such, never reported busy\n                _refuse_foreign(name)\n                if not os.path.exists(os.path.join(SHM_DIR, name)):  # reclaimed: another shape\n                    return cls.create(\n                        name, num_slots, row_bytes, engine_id, size_hint_key, janitor, table, keep_s\n                    )\n            # not a live engine's by its header: the lock that kept it here may have been another\n            # process's look at it (a sweep, a listing), held for a moment; look again before\n            # failing the start\n            if False:\n",
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
        "                        if rec.kind is TaskKind.LOAD and code == m.TIMEOUT:\n",
        "                        if False:\n",
        (FS + "test_c16_dropped_load_turns_pending_into_miss_after_the_deadline",),
    ),
    Mutation(
        "C16",
        "an orphaned store keeps its capacity reservation",
        "kvoffload/tiers/capacity.py",
        "            nbytes = self.reserved.pop(key, None)\n",
        "            nbytes = self.reserved.get(key)\n",
        (FS + "test_c16_dropped_store_releases_its_reservation_after_the_deadline",),
    ),
    Mutation(
        "C16",
        "a timed-out store's host pins are kept",
        "kvoffload/tiering.py",
        "        self.host.unpin_slots(meta.slots)\n",
        "",
        (FS + "test_c16_dropped_store_releases_its_reservation_after_the_deadline",),
    ),
    Mutation(
        "C18",
        "a peer's lookup is answered from the host tier only",
        "kvoffload/serving.py",
        "                if tier.medium == PEER_MEDIUM:\n",
        "                if True:\n",
        (P2PH + "test_c18_a_chunk_moved_to_the_fs_tier_is_still_served_to_peers",),
    ),
    Mutation(
        "C28",
        "a released lease drops one pin per slot, whatever it holds",
        "kvoffload/serving.py",
        "            unpin((slot,) * n)\n",
        "            unpin((slot,))\n",
        (P2PH + "test_leases_pin_per_holder_and_release_drops_only_their_own_pins",),
    ),
    Mutation(
        "C17",
        "a failed store published",
        "kvoffload/tiers/process.py",
        "            self.verdicts.mark_present(ok_keys)\n",
        "            self.verdicts.mark_present(meta.keys)\n",
        (FS + "test_c17_worker_that_dies_or_goes_silent_fails_or_reruns_its_jobs",),
    ),
    Mutation(
        "C17",
        "a late reply from a replaced worker accepted",
        "kvoffload/tiers/workerpool.py",
        "        if w is None or w.killed:\n            return None\n",
        (
            "        if w is None or w.killed:\n"
            "            w = next((x for x in self._by_wid.values() if task_id in x.inflight), None)\n"
            "            if w is None:\n"
            "                return None\n"
        ),
        (FS + "test_c17_worker_that_dies_or_goes_silent_fails_or_reruns_its_jobs",),
    ),
    Mutation(
        "C17",
        "a dead worker's tasks neither re-run nor failed",
        "kvoffload/tiers/workerpool.py",
        "                self.queue.extendleft(reversed(rerun))  # first in line, in their original order\n",
        "",
        (FS + "test_c17_worker_that_dies_or_goes_silent_fails_or_reruns_its_jobs",),
    ),
    Mutation(
        "C17",
        "a peer worker that stops reporting is never killed",
        "kvoffload/tiers/p2p/worker_handle.py",
        "        if why:\n",
        "        if why and False:\n",
        (P2PW + "test_c17_a_hung_peer_worker_is_killed_so_its_transfers_settle",),
    ),
    Mutation(
        "C18",
        "a chunk leaving one tier of a peer is unregistered from all of them",
        "kvoffload/tiers/p2p/locations.py",
        "                        bits &= ~bit\n",
        "                        bits = 0\n",
        (
            LOC + "test_c18_a_chunk_spilled_to_a_peers_fs_tier_stays_located_until_it_leaves_"
            "every_tier",
        ),
    ),
    Mutation(
        "C18",
        "a salted lookup is located by its tenant key",
        "kvoffload/tiers/p2p/tier.py",
        "        self._node.submit(Probe(key, head, tail, None if located_as == key else located_as))\n",
        "        self._node.submit(Probe(key, head, tail))\n",
        (TIER + "test_c18_a_salted_lookup_asks_the_peer_whose_kv_events_show_the_chunk_first",),
    ),
    Mutation(
        "C18",
        "the node asks the locations with the key peers are asked for",
        "kvoffload/tiers/p2p/client.py",
        "                        located = where(cmd.located_as or cmd.key) if where is not None else ()\n",
        "                        located = where(cmd.key) if where is not None else ()\n",
        (P2PC + "test_a_probe_is_located_by_its_engine_key_and_asks_for_its_tenant_key_only",),
    ),
    # -- C19-C23: metrics, events, config, buffer lifetime, performance ---------------------------
    Mutation(
        "C19",
        "requested chunks counted only when they hit",
        "kvoffload/metrics.py",
        '        m.set_total("kvoffload_lookup_requested_chunks", st.host_queries)\n',
        '        m.set_total("kvoffload_lookup_requested_chunks", st.host_hits + sum(tier_hits.values()))\n',
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
        "            self.bound_capacity(max_bytes, self.file_bytes, full_why)\n",
        "            pass\n",
        (FS + "test_c21_capacity_setting_is_enforced",),
    ),
    Mutation(
        "C21",
        "no near-miss suggestion for a misspelled tier key",
        "kvoffload/validation.py",
        "    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)\n",
        "    close = []\n",
        (
            CFG + "test_c21_misspelled_tier_key_names_the_tier_path",
            CFG + "test_c21_misspelled_top_level_key_suggests_the_right_one",
        ),
    ),
    Mutation(
        "C21",
        "the resolved config not logged at start",
        "kvoffload/vllm/spec.py",
        '            log.info("kvoffload: %s", describe(self.settings))\n',
        "",
        (SPEC + "test_c21_the_resolved_config_is_logged_once_at_start",),
    ),
    Mutation(
        "C22",
        "a store's source slot not pinned while the writer reads it",
        "kvoffload/tiering.py",
        "        slots = self.host.pin(take)\n",
        "        slots = [self.host.index[k] for k in take]\n",
        (FS + "test_c22_store_source_slot_is_not_reused_while_the_writer_reads_it",),
    ),
    Mutation(
        "C23",
        "a full, fully pinned host tier asks the policy anyway",
        "kvoffload/host.py",
        "            if need > self.num_evictable - len(mine):\n                return None\n",
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
            '            log_contained(self.errors, self.who, f"{what} {key.hex()[:16]}", e)\n'
        ),
        (
            '            return IOOutcome(code, 0, f"{what} {key.hex()[:16]}: {e}")\n'
            "        except OSError as e:\n"
            '            log_contained(self.errors, self.who, f"{what} {key.hex()[:16]}", e)\n'
        ),
        (WC + "test_c25_an_injected_non_io_error_fails_its_key_and_the_worker_goes_on",),
    ),
    Mutation(
        "C25",
        "a worker crash blamed on the oldest task in flight, not on the one its marker names",
        "kvoffload/tiers/workerpool.py",
        "                running = {next(iter(w.inflight), -1)} if marked is None else marked\n",
        "                running = {next(iter(w.inflight), -1)}\n",
        (WC + "test_c25_a_task_that_kills_its_worker_is_not_rerun_on_a_second_worker",),
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
            "            self.quotas.clear()\n"
            "        if removed and self._events is not None:\n"
            "            self._events.append(TierEvent(removed, True))\n"
            "        return busy\n"
        ),
        (
            "            self.quotas.clear()\n"
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
        ("                    self.stats.unheld_completions += 1\n                    continue\n"),
        (
            "                    self.stats.unheld_completions += 1\n"
            "                    if k in host.index:\n"
            "                        host.unpin_slot(host.index[k])\n"
            "                    continue\n"
        ),
        (WB + "test_c28_a_duplicated_completion_never_releases_another_requests_pin",),
    ),
    Mutation(
        "C28",
        "a store completion from another request ends a write",
        "kvoffload/tiering.py",
        "                if writes.get(k) == req_id:\n",
        "                if k in writes:\n",
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
        '                self._direct_refused("writes", "the open", e, leftover=(d, tmp))\n',
        '                self._direct_refused("writes", "the open", e)\n',
        (
            WC + "test_c31_a_filesystem_refusing_direct_io_half_way_stores_everything_buffered"
            "[direct_open_created]",
        ),
    ),
    Mutation(
        "C32",
        "a chunk file whose removal failed is forgotten",
        "kvoffload/tiers/capacity.py",
        "            ident = self._count(k, nbytes)\n"
        "            self.ranks.fresh((ident,))\n"
        "            self._evictable((ident,))\n",
        "            pass\n",
        (CAP + "test_c32_undeletable_chunk_file_stays_counted_and_the_next_lru_is_evicted[fault]",),
    ),
    Mutation(
        "C33",
        "a full disk does not lower the tier's cap",
        "kvoffload/tiers/process.py",
        "            self._medium_full(full, free_bytes)\n",
        "            pass\n",
        (CAP + "test_c33_disk_full_before_the_cap_evicts_own_lru_chunks_and_stores_go_on",),
    ),
    Mutation(
        "C34",
        "stored-block events without parent hash and token ids",
        "kvoffload/kv_events.py",
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
        "kvoffload/vllm/spec.py",
        "    return shards * max(par.dcp_size, 1) * max(par.pcp_size, 1)\n",
        "    return 1\n",
        (XTP + "test_c35_canonical_layout_is_shared_across_tensor_parallel_sizes",),
    ),
    Mutation(
        "C35",
        "the scheduler reads vLLM's current config, which its process does not set",
        "kvoffload/vllm/compat.py",
        '    found = _calling_local("vllm_config", VllmConfig, 32)\n',
        "    found = None\n",
        (
            SPEC
            + "test_c35_scheduler_and_model_runner_size_canonical_rows_alike_past_the_kv_heads",
            SPEC + "test_c02_the_scheduler_namespace_carries_vllms_model_revision",
            SPEC + "test_a_host_tier_smaller_than_one_request_is_warned_in_the_scheduler",
        ),
    ),
    Mutation(
        "C36",
        "a request waiting on a probe is not owed its MISS",
        "kvoffload/tiers/verdicts.py",
        # where a probe's absent answer makes the waiting requests owed (a lookup reads the debt
        # in two places: verdict(), which pays it, and absent_for(), which a request's scout
        # checks: mutating one of them alone left the other answering MISS)
        "        if waiting:\n            self.owe_miss(key, waiting)\n",
        "        if False:\n            self.owe_miss(key, waiting)\n",
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
    # -- C38-C55: cases added after the peer tier was tried by an attacker and by operators -------
    Mutation(
        "C44",
        "sweeping removes another user's segment whose owner is gone",
        "ipc/arena.py",
        "        why = _not_ours(st)\n        if why is not None:\n            return SkippedSegment(",
        "        why = None\n        if why is not None:\n            return SkippedSegment(",
        (
            CO + "test_c44_sweep_leaves_another_users_segments_alone_and_logs_each_once",
            CO + "test_c44_the_janitor_never_removes_another_users_segment_under_its_arenas_name",
        ),
    ),
    Mutation(
        "C44",
        "a segment sweeping cannot open stops the sweep (and the engine's start)",
        "ipc/arena.py",
        "    except OSError as e:\n        return _unopenable(name, e)\n",
        "    except OSError:\n        raise\n",
        (CO + "test_c44_a_non_root_engine_start_is_not_stopped_by_another_users_segment",),
    ),
    Mutation(
        "C44",
        "a co-tenant's segment is logged again at every engine start",
        "ipc/arena.py",
        "        if skipped.name in _reported:\n            return\n",
        "",
        (CO + "test_c44_sweep_leaves_another_users_segments_alone_and_logs_each_once",),
    ),
    Mutation(
        "C44",
        "the janitor raises on a segment it cannot open",
        "ipc/arena.py",
        "        except (OSError, ArenaError):\n            return False  # gone, or not ours to open",
        "        except FileNotFoundError:\n            return False",
        (CO + "test_c44_a_non_root_engine_start_is_not_stopped_by_another_users_segment",),
    ),
    Mutation(
        "C44",
        "an engine attaches another user's 0600 segment under its fixed arena_name",
        "ipc/arena.py",
        "    st = os.fstat(fd)\n    why = _not_ours(st)\n    if why is None and",
        "    st = os.fstat(fd)\n    why = None\n    if why is None and",
        (CO + "test_c44_a_squatters_segment_under_a_fixed_arena_name_is_refused[0600]",),
    ),
    Mutation(
        "C44",
        "an engine attaches a segment readable or writable by others",
        "ipc/arena.py",
        "    if why is None and stat.S_IMODE(st.st_mode) != ARENA_MODE:\n",
        "    if False:\n",
        (CO + "test_c44_own_segment_readable_by_others_is_not_attached",),
    ),
    Mutation(
        "C44",
        "an engine attaches another engine's arena that uses the same arena_name",
        "ipc/arena.py",
        "                    if engine_id and hengine != _header_engine_id(engine_id):\n",
        "                    if False:\n",
        (CO + "test_c44_another_engines_arena_under_the_same_name_is_not_attached",),
    ),
    Mutation(
        "C44",
        "kvoffload sweep --list shows another user's segment as a dead engine's",
        "tools/cli.py",
        "            if not a.ours:\n",
        "            if False:\n",
        (CO + "test_c44_kvoffload_sweep_lists_another_users_segment_as_not_ours",),
    ),
    # -- C43, C45: shared persistent tiers against co-tenants and hostile storage ---------------
    Mutation(
        "C43",
        "directories and chunk files get what the umask leaves of rwx for all",
        "workers/fs_io.py",
        "PRIVATE_MODES = (0o700, 0o600)\n",
        "PRIVATE_MODES = (0o777, 0o666)\n",
        (
            FS + "test_c43_directories_and_files_get_the_tiers_modes_whatever_the_umask[private-0]",
            COT + "test_c43_a_cotenant_reads_no_chunk_and_lists_no_name_of_a_private_root",
        ),
    ),
    Mutation(
        "C43",
        "a directory inside the root is opened through a symbolic link",
        "workers/fs_io.py",
        "DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC\n",
        "DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC\n",
        (
            FS + "test_c43_a_symlinked_shard_directory_gets_no_store_and_is_removed",
            COT
            + "test_c43_a_shard_directory_link_a_group_member_plants_sends_nothing_outside_the_root",
        ),
    ),
    Mutation(
        "C43",
        "a chunk file is read through a symbolic link",
        "workers/fs_io.py",
        "_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC\n",
        "_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC\n",
        (FS + "test_c43_a_symlink_at_a_chunk_path_is_never_read_through",),
    ),
    Mutation(
        "C43",
        "the fs worker serves a chunk whose MAC it does not check",
        "workers/fs_io.py",
        "        if self._mac_key is not None:\n            why = cf.mac_problem(head, into, self._mac_key)\n",
        "        if False:\n            why = cf.mac_problem(head, into, self._mac_key)\n",
        (
            FS
            + "test_c43_with_an_integrity_key_a_chunk_written_without_it_is_a_forged_miss_and_removed",
            COT + "test_c43_a_chunk_a_group_member_plants_is_a_forged_miss_with_an_integrity_key",
        ),
    ),
    Mutation(
        "C43",
        "the obj worker serves an object whose MAC it does not check",
        "workers/obj_io.py",
        "        if self._mac_key is not None:\n            why = cf.mac_problem(header, payload, self._mac_key)\n",
        "        if False:\n            why = cf.mac_problem(header, payload, self._mac_key)\n",
        (
            OBJ
            + "test_c43_with_an_integrity_key_an_object_written_without_it_is_a_forged_miss_and_deleted",
        ),
    ),
    Mutation(
        "C45",
        "the obj worker reads a body to its end",
        "workers/obj_io.py",
        "                data = read_at_most(body, self.object_bytes + 1)\n",
        "                data = body.read()\n",
        (
            OBJ
            + "test_c45_a_hostile_body_is_a_corrupt_miss_and_the_readers_memory_stays_flat[endless]",
        ),
    ),
    Mutation(
        "C45",
        "the obj worker reads a body whose Content-Length is not one object's",
        "workers/obj_io.py",
        "            if length is not None and length != self.object_bytes:\n",
        "            if False:\n",
        (
            OBJ + "test_c45_a_hostile_body_is_a_corrupt_miss_and_the_readers_memory_stays_flat"
            "[lying_length]",
        ),
    ),
    Mutation(
        "C38",
        "a request's route is dialed whether or not it names an allowed peer",
        "kvoffload/tiers/p2p/tier.py",
        "            if why is not None:\n                self._refuse_route(route.source, why)\n",
        "            if False:\n                self._refuse_route(route.source, why)\n",
        (ATT + "test_c38_a_request_naming_an_address_that_is_no_allowed_peer_makes_no_socket",),
    ),
    Mutation(
        "C38",
        "the server takes a Hello carrying its own incarnation",
        "kvoffload/tiers/p2p/server.py",
        "        if hello.incarnation == self.incarnation:  # our own client's Hello",
        "        if False:  # our own client's Hello",
        (
            P2PS
            + "test_c38_a_hello_carrying_the_servers_own_incarnation_is_refused_as_a_reflection",
            ATT + "test_c38_a_relay_without_the_secret_between_our_client_and_our_own_server_"
            "gets_nothing",
        ),
    ),
    Mutation(
        "C38",
        "the server takes a Hello that dialed another address",
        "kvoffload/tiers/p2p/server.py",
        "        if hello.dialed not in self.addresses:",
        "        if False:",
        (
            P2PS
            + "test_c38_a_hello_naming_a_dialed_address_not_the_servers_is_refused_as_misrouted",
            ATT + "test_c38_a_relay_to_another_peer_completes_no_session_there_either",
        ),
    ),
    Mutation(
        "C38",
        "the control sockets run without CurveZMQ: a relay reads the handshake",
        "kvoffload/tiers/p2p/node.py",
        "            if secret:\n                self._curve = pm.curve_keypair(secret)\n",
        "            if False:\n                self._curve = pm.curve_keypair(secret)\n",
        (
            ATT + "test_c38_a_relay_without_the_secret_between_our_client_and_our_own_server_"
            "gets_nothing",
        ),
    ),
    Mutation(
        "C38",
        "the client's MAC leaves its descriptor out",
        "ipc/peer_messages.py",
        "        msg = msgspec.structs.replace(msg, mac=ZERO_MAC)\n",
        "        msg = msgspec.structs.replace(msg, mac=ZERO_MAC)\n"
        "        if isinstance(msg, Auth):\n"
        '            msg = msgspec.structs.replace(msg, descriptor=b"")\n',
        (P2PS + "test_c38_every_field_of_the_handshake_is_under_the_macs",),
    ),
    Mutation(
        "C38",
        "links requests named are never forgotten",
        "kvoffload/tiers/p2p/client.py",
        "                if self._idle(link):\n                    self._forget_link(link, now)\n",
        "                if False:\n                    self._forget_link(link, now)\n",
        (
            P2PC + "test_c38_links_requests_named_are_bounded_and_forgotten_when_unused",
            ATT + "test_c38_300_request_named_allowed_addresses_leave_at_most_the_bound_and_"
            "none_when_idle",
        ),
    ),
    Mutation(
        "C41",
        "one source may hold any number of half-open connections",
        "kvoffload/tiers/p2p/node.py",
        "        if per_source[source] >= self.max_half_open_per_source:\n",
        "        if False:\n",
        (ATT + "test_c41_a_flood_of_unauthenticated_connections_locks_no_honest_peer_out",),
    ),
    Mutation(
        "C41",
        "one source may fill the server's handshake table",
        "kvoffload/tiers/p2p/server.py",
        "        if self._per_source[source] >= self.max_handshakes_per_source:\n",
        "        if False:\n",
        (P2PS + "test_c41_one_source_cannot_fill_the_handshake_table_nor_push_out_anothers",),
    ),
    Mutation(
        "C42",
        "a second live instance at a peer's address is taken for its restart",
        "kvoffload/tiers/p2p/server.py",
        "            if other.incarnation != hello.incarnation and self._alive(other, now):\n",
        "            if False:\n",
        (
            P2PS + "test_c42_a_second_live_instance_claiming_a_peers_address_is_refused_and_both_"
            "keep_theirs",
            ATT_NS + "test_c42_two_readers_in_two_namespaces_advertising_one_address",
        ),
    ),
    Mutation(
        "C38",
        "with auth none a session's claimed address allows requests to name it",
        "kvoffload/tiers/p2p/tier.py",
        "if node is not None and self._secret else ()",
        "if node is not None else ()",
        (
            ATT + "test_c38_with_auth_none_a_session_claiming_an_address_allows_no_request_to_"
            "name_it",
        ),
    ),
    Mutation(
        "C38",
        "a new request link makes the least recently used go even while busy",
        "kvoffload/tiers/p2p/client.py",
        "                    victim = next((lk for lk in links if self._idle(lk)), None)\n",
        "                    victim = None\n",
        (P2PC + "test_c38_a_new_request_link_makes_an_idle_one_go_before_a_busy_one",),
    ),
    Mutation(
        "C42",
        "a peer advertising this instance's own address is welcomed",
        "kvoffload/tiers/p2p/server.py",
        "        if hello.advertise in self.addresses:  # another instance claims to be this one\n",
        "        if False:\n",
        (
            P2PS + "test_c42_a_peer_advertising_this_instances_own_address_is_refused_as_a_"
            "collision",
        ),
    ),
    # -- C39-C46 (the p2p data plane): grants, digests, lease lifetimes, sizes, fair leases -------
    Mutation(
        "C39",
        "the p2p data server serves reads no live grant of the session covers",
        "workers/p2p_transport.py",
        "            if isinstance(held, str):\n"
        '                self._deny(conn, req.xfer_id, f"{held}: no live grant of this session", held)\n',
        "            if isinstance(held, str):\n"
        "                held = []\n"
        "            if False:\n"
        '                self._deny(conn, req.xfer_id, f"{held}: no live grant of this session", held)\n',
        (
            P2PT
            + "test_c39_the_tcp_data_server_serves_only_reads_a_live_grant_of_the_session_covers",
            TIER
            + "test_c39_an_authenticated_peer_reads_only_what_it_leased_while_the_lease_lives_and_"
            "writes_nothing",
            P2PT + "test_fuzzed_frames_on_the_data_port_read_nothing_ungranted_and_break_nothing",
        ),
    ),
    Mutation(
        "C39",
        "the peer worker is spawned with the engine's whole environment, its p2p secret included",
        "kvoffload/supervisor.py",
        "        env = child_environment(env_allow, env_set)\n",
        "        env = {**os.environ, **(env_set or {})}\n",
        (P2PW + "test_the_peer_worker_gets_no_secret_of_the_engines_environment",),
    ),
    Mutation(
        "C40",
        "the reading worker serves a chunk that does not match its digest",
        "workers/p2p_transport.py",
        "                x.bad.append(i)\n",
        "                pass\n",
        (
            P2PW
            + "test_c40_a_chunk_changed_after_its_grant_is_reported_bad_and_the_others_are_good[tcp]",
            TIER
            + "test_c40_a_serving_slot_refilled_while_the_read_is_in_flight_is_a_miss_never_its_bytes"
            "[tcp]",
        ),
    ),
    Mutation(
        "C40",
        "the reader runs its transfer to its own lease, not the one it was granted",
        "kvoffload/tiers/p2p/client.py",
        "            not_after = part.t0 + msg.ttl_s - lease_margin_s(msg.ttl_s)\n",
        "            not_after = part.t0 + self.lease_ttl_s\n",
        (
            TIER + "test_c40_a_lease_that_lapses_while_the_server_is_stalled_is_never_served",
            P2PC
            + "test_c40_a_read_is_checked_against_the_digests_and_over_before_the_lease_may_end",
        ),
    ),
    Mutation(
        "C45",
        "the p2p data server reads a request frame of any length",
        "workers/p2p_transport.py",
        "            if n > MAX_REQUEST_BYTES:\n",
        "            if False:\n",
        (
            P2PW
            + "test_c45_lying_and_endless_frames_on_the_data_port_close_it_and_memory_stays_flat",
        ),
    ),
    Mutation(
        "C45",
        "the reading worker takes a data server's reply frame of any length",
        "workers/p2p_transport.py",
        "        reply = _reply_decoder.decode(_recv_frame(sock, deadline, MAX_REPLY_BYTES))\n",
        "        reply = _reply_decoder.decode(_recv_frame(sock, deadline, 1 << 32))\n",
        (P2PW + "test_c45_a_hostile_data_server_fails_the_read_and_the_readers_memory_stays_flat",),
    ),
    Mutation(
        "C46",
        "one peer may hold the whole lease cap while another is connected",
        "kvoffload/tiers/p2p/server.py",
        "        return max(1, self.max_leased_chunks // max(1, len(self._sessions)))\n",
        "        return self.max_leased_chunks\n",
        (
            P2PS
            + "test_c46_a_peer_leasing_all_it_can_and_never_reading_leaves_the_other_peer_its_share",
            P2PS + "test_c46_leases_a_peer_holds_without_reading_are_taken_back_for_another_peer",
        ),
    ),
    Mutation(
        "C46",
        "leases held without reading are never taken back for another peer",
        "kvoffload/tiers/p2p/server.py",
        "                    self._reclaim(session, short, now)\n",
        "                    pass\n",
        (
            P2PS + "test_c46_leases_a_peer_holds_without_reading_are_taken_back_for_another_peer",
            TIER + "test_c46_a_peer_that_leases_all_it_can_and_never_reads_does_not_starve_another",
        ),
    ),
    Mutation(
        "C47",
        "a request's chunks ranked head lowest",
        "kvoffload/policies.py",
        "                minor[slot] = -pos\n",
        "                minor[slot] = pos\n",
        (POL + "test_c47_a_pin_keeps_a_chunks_rank_and_a_request_ranks_its_tail_lowest",),
    ),
    Mutation(
        "C47",
        "a pin drops a chunk's rank and an unpin ranks it as just used",
        "kvoffload/policies.py",
        "            return\n        self._heap.add(slots)\n",
        "            return\n        self.ranks.fresh(slots)\n        self._heap.add(slots)\n",
        (
            POL + "test_c47_a_pin_keeps_a_chunks_rank_and_a_request_ranks_its_tail_lowest",
            POL_RIG + "test_c47_a_write_through_does_not_move_chunks_in_the_eviction_order",
        ),
    ),
    Mutation(
        "C47",
        "ARC evicts T2's candidate before an older tail in T1",
        "kvoffload/policies.py",
        "                    if theirs < mine and (lst == _T2 or theirs[0] == mine[0]):\n",
        "                    if theirs < mine and theirs[0] == mine[0]:\n",
        (POL_RIG + "test_c47_a_prefix_tail_is_evicted_before_its_head",),
    ),
    Mutation(
        "C47",
        "a store that completes after its request finished brings the request back",
        "kvoffload/policies.py",
        "        if req is None and request in self.done:\n",
        "        if False:\n",
        (POL + "test_c47_a_store_that_completes_after_its_request_finished_keeps_the_order",),
    ),
    Mutation(
        "C47",
        "ARC's T1 candidate goes before a lower-ranked tail of its request in T2",
        "kvoffload/policies.py",
        "                    if theirs < mine and (lst == _T2 or theirs[0] == mine[0]):\n",
        "                    if theirs < mine and lst == _T2:\n",
        (POL + "test_c47_arc_evicts_a_tail_counted_as_used_before_its_new_head",),
    ),
    Mutation(
        "C47",
        "a peer's lease is a request of the host tier's policy",
        "kvoffload/serving.py",
        "        host.access(used)  # a use now, tail first: not a request of the policy's (C47 review)\n",
        "        host.access(used, holder)\n",
        (POL_RIG + "test_c47_a_peers_leases_take_no_place_among_the_engines_requests",),
    ),
    Mutation(
        "C47",
        "a capped tier ranks each job's chunks as used one by one, head first (plain LRU)",
        "kvoffload/tiers/capacity.py",
        "            self._heap.reranked(self.ranks.rank(request, batch, use))\n",
        "            self._heap.reranked(self.ranks.rank('', batch[::-1], use))\n",
        (
            CAP
            + "test_c47_the_fs_tier_evicts_a_prefix_tail_first_and_a_prefix_read_back_keeps_its_head",
        ),
    ),
    Mutation(
        "C47",
        "a capped tier's finished request keeps its running rank",
        "kvoffload/tiers/capacity.py",
        "        self._heap.reranked(self.ranks.finished(request))\n",
        "        self._heap.reranked(self.ranks.finished(request)[:0])\n",
        (
            CAP
            + "test_c47_the_fs_tier_evicts_a_prefix_tail_first_and_a_prefix_read_back_keeps_its_head",
        ),
    ),
    Mutation(
        "C48",
        "a request's later chunks are written to a tier past one dropped there",
        "kvoffload/tiering.py",
        "        if holes is not None and i in holes:\n",
        "        if False:\n",
        (BP + "test_c48_a_request_whose_chunk_was_dropped_or_failed_writes_nothing_past_it",),
    ),
    Mutation(
        "C48",
        "a chunk that failed in a tier leaves no hole for its request's later chunks",
        "kvoffload/tiering.py",
        "                self._hole(meta.req_id, job.tier)  # its later chunks are not written there\n",
        "                pass\n",
        (BP + "test_c48_a_request_whose_chunk_was_dropped_or_failed_writes_nothing_past_it",),
    ),
    Mutation(
        "C49",
        "a prefill's chunks found stored are not held for its decoder",
        "kvoffload/tiering.py",
        "            if req_id and self._hold_covered:\n",
        "            if False:\n",
        (TIER + "test_c49_a_repeat_prefill_holds_the_chunks_it_found_for_its_own_decoder",),
    ),
    # -- C50: counters count what a tier did ---------------------------------------------------------
    Mutation(
        "C50",
        "a tier's store bytes are its chunks stored times the row bytes",
        "kvoffload/metrics.py",
        '                "kvoffload_tier_transfer_bytes", moved.get((name, "store"), 0), name, "store"\n',
        '                "kvoffload_tier_transfer_bytes", st.cascaded[name] * r.slot_bytes, name, "store"\n',
        (TRUTH + "test_c50_stores_of_chunks_already_stored_write_no_bytes_and_are_counted_apart",),
    ),
    Mutation(
        "C50",
        "stores of chunks a tier already held count as chunks moved",
        "kvoffload/tiering.py",
        "        stats.written[tier.name] += max(0, len(stored) - held)\n",
        "        stats.written[tier.name] += len(stored)\n",
        (
            TRUTH + "test_c50_stores_of_chunks_already_stored_write_no_bytes_and_are_counted_apart",
            TRUTH + "test_c50_the_memory_tier_counts_a_chunk_it_holds_as_deduplicated",
        ),
    ),
    Mutation(
        "C50",
        "the fs worker answers a chunk found stored as an ordinary store",
        "workers/fs_io.py",
        "                return OK_PRESENT\n",
        "                return OK_EMPTY\n",
        (TRUTH + "test_c50_stores_of_chunks_already_stored_write_no_bytes_and_are_counted_apart",),
    ),
    # -- C51, C52: recovery after faults, measured --------------------------------------------------
    Mutation(
        "C51",
        "the breaker's back-off ignores breaker_max_cooldown_s",
        "kvoffload/tiers/breaker.py",
        "        return min(self.max_cooldown_s, self.cooldown_s * 2.0 ** min(self.open_count, 64))\n",
        "        return self.cooldown_s * 2.0 ** min(self.open_count, 4)\n",
        (
            OBJ + "test_c51_after_an_outage_the_breaker_closes_within_its_max_cooldown_of_recovery",
            BRK + "test_c51_the_cooldown_never_exceeds_max_cooldown_s_so_recovery_is_bounded",
        ),
    ),
    Mutation(
        "C52",
        "an ENOSPC with room on the disk lowers the cap all the same",
        "kvoffload/tiers/fs.py",
        "        if free_bytes >= 0 and room >= chunks * self.file_bytes + cap.reserved_bytes():\n",
        "        if False:\n",
        (
            CAP
            + "test_c52_a_burst_of_enospc_on_a_disk_with_room_evicts_nothing_and_every_chunk_is_served",
        ),
    ),
    Mutation(
        "C52",
        "the fs worker does not measure the free space after ENOSPC",
        "workers/fs_io.py",
        "        return IOOutcome(m.NO_SPACE, 0, detail, free_bytes=free)\n",
        "        return IOOutcome(m.NO_SPACE, 0, detail)\n",
        (
            CAP
            + "test_c52_a_burst_of_enospc_on_a_disk_with_room_evicts_nothing_and_every_chunk_is_served",
        ),
    ),
    Mutation(
        "C52",
        "a short disk's room is ignored: the cap falls to what the tier holds",
        "kvoffload/tiers/capacity.py",
        "        cap = held + room\n",
        "        cap = held\n",
        (
            CAPU
            + "test_c52_a_short_medium_frees_only_its_shortage_never_more_than_the_failed_stores",
        ),
    ),
    Mutation(
        "C53",
        "a chunk's stored event names every block with the engine block size",
        "kvoffload/kv_events.py",
        "                                block_hashes=info.block_hashes[-1:],\n"
        "                                parent_block_hash=info.parent_block_hash,\n"
        "                                token_ids=info.token_ids,\n"
        "                                block_size=info.block_size * len(info.block_hashes),\n",
        "                                block_hashes=list(info.block_hashes),\n"
        "                                parent_block_hash=info.parent_block_hash,\n"
        "                                token_ids=info.token_ids,\n"
        "                                block_size=info.block_size,\n",
        (RV + "test_c53_chunk_events_credit_whole_chunks_only_as_the_engine_serves_them",),
    ),
    Mutation(
        "C54",
        "a run does not open with AllBlocksCleared",
        "kvoffload/events.py",
        "        self.publish([AllBlocksCleared()], [])\n",
        "",
        (
            RV
            + "test_c54_after_a_sigkill_and_restart_in_place_the_router_sees_what_the_instance_serves",
        ),
    ),
    Mutation(
        "C54",
        "chunks adopted at start are not announced",
        "kvoffload/tiers/process.py",
        "        if fresh and self.record_events:\n            index = self.capacity.index\n",
        "        if False:\n            index = self.capacity.index\n",
        (
            RV
            + "test_c54_after_a_sigkill_and_restart_in_place_the_router_sees_what_the_instance_serves",
        ),
    ),
    Mutation(
        "C55",
        "the fs tier publishes the removal of adopted chunks it never announced",
        "kvoffload/tiers/fs.py",
        "        self._enforce_cap(unannounced=fresh)\n",
        "        self._enforce_cap()\n",
        (
            RV
            + "test_c55_on_a_shared_root_removals_come_from_the_instances_that_announced_the_chunks",
        ),
    ),
    Mutation(
        "C55",
        "a load that finds an announced chunk gone publishes no removal",
        "kvoffload/tiers/process.py",
        "            if vanished and self.record_events:\n",
        "            if False:\n",
        (
            RV
            + "test_c55_on_a_shared_root_removals_come_from_the_instances_that_announced_the_chunks",
        ),
    ),
    Mutation(
        "C44",
        "a squatter that takes the name during a warm-restart claim is reported busy, not foreign",
        "ipc/arena.py",
        "                _refuse_foreign(name)\n                if not os.path.exists",
        "                if not os.path.exists",
        (WA + "test_c44_a_squatter_that_takes_the_name_while_a_successor_claims_it_is_refused",),
    ),
    Mutation(
        "C44",
        "the keeper takes over another user's segment under its arena's name",
        "ipc/janitor.py",
        "        if am._not_ours(os.fstat(fd)) is not None:\n",
        "        if False:\n",
        (WA + "test_c44_a_keeper_never_takes_over_another_users_segment_under_its_arenas_name",),
    ),
    Mutation(
        "C56",
        "a kept arena nobody holds is not claimed",
        "ipc/arena.py",
        "        if state == _STATE_KEPT:\n",
        "        if state == _STATE_KEPT and _owner_alive(fd):\n",
        (
            WA
            + "test_c56_a_claimant_that_dies_after_the_keeper_let_go_leaves_the_arena_to_the_next",
        ),
    ),
    Mutation(
        "C56",
        "a reused owner pid reads as the live owner",
        "ipc/arena.py",
        "not _pid_alive(owner_pid, created_ns)",
        "not _pid_alive(owner_pid)",
        (WA + "test_c56_a_claimant_waits_for_the_keeper_when_the_dead_owners_pid_was_reused",),
    ),
    Mutation(
        "C56",
        "an arena left keeping by a dead keeper waits for the age of an unready one",
        "ipc/arena.py",
        "header[2] not in (_STATE_READY, _STATE_KEEPING)",
        "header[2] != _STATE_READY",
        (
            WA
            + "test_c56_a_keeper_killed_while_taking_over_leaves_nothing_to_adopt_and_the_successor_starts_cold",
        ),
    ),
    Mutation(
        "C56",
        "another user's process with the keeper's command line counts as the keeper",
        "ipc/arena.py",
        "            and p.uids().effective == os.geteuid()\n",
        "",
        (
            WA
            + "test_a_dead_engines_arena_whose_keeper_pid_names_another_live_process_is_not_kept"
            + "[another_users_lookalike]",
        ),
    ),
    Mutation(
        "C56",
        "a start fails on an owner lock that another process's sweep holds for a moment",
        "ipc/arena.py",
        "            if not _live_engine(name) and _remove_if_stale(name, _PROBE_PATIENCE_S) is True:\n",
        "            if False:\n",
        (
            WA
            + "test_c56_a_sweep_looking_at_a_stale_arena_as_the_successor_starts_does_not_fail_it",
        ),
    ),
]
