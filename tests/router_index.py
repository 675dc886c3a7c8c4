"""A router's view of KV events: the test helper that applies a publisher's stream as llm-d's
indexer does (llm-d-kv-cache ``pkg/kvevents/pool.go``, ``engineadapter/vllm_adapter.go``,
``kvcache/kvblock/in_memory.go``), so tests can check that what kvoffload announces is what its
engine can serve (CASES C53-C55).

::

    publisher ──PUB (topic, seq, KVEventBatch)──▶ SUB ─┐ Subscription.poll(): per pod, in order
              ◀─(b"", start_seq)── DEALER (replay) ───┤   seq went back: a restart ─▶ replay from 0
                                                      │   seq jumped: a gap ─▶ replay from expected
                                                      ▼
                 RouterIndex.apply(pod, payload) ─▶ per pod, per medium: block hash ─▶ entry
                 RouterIndex.lookup(pod, prefix hashes) ─▶ per medium: engine blocks credited

What it takes from llm-d, and what it assumes where llm-d leaves a choice:

- **Wire.** A batch is ``[ts, events, data_parallel_rank]``. An event is either a msgpack array
  in vLLM's field order (``["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name, extra_keys, group_idx, ...]``, ``["BlockRemoved",
  block_hashes, medium, group_idx, ...]``, ``["AllBlocksCleared"]``: the layout llm-d's adapter
  decodes) or a map tagged ``type`` (vLLM 0.32's and kvoffload's encoding); both are read.
  ``medium`` is lower-cased, None is ``gpu`` (llm-d's ``defaultEventSourceDeviceTier``).
- **Keys.** Entries are kept per pod and per medium, keyed by the engine's block hash. llm-d
  keys its index by request keys it hashes from the event's tokens at its own block size,
  with an engine-hash -> request-key mapping; with that block size equal to the event's
  ``block_size`` (the documented setting, ``docs/observability.md``) one engine hash is one
  request key, so keying by engine hash gives the same answers.
- **BlockStored.** Each hash covers ``block_size`` tokens, chained: the first hash's parent is
  ``parent_block_hash``, each next one's the hash before it. An event whose parent is not known
  (llm-d: no engine -> request mapping for it) is skipped. An event without tokens (kvoffload's
  plain form, llm-d's "device tier update") is applied only to hashes already known from an
  event with tokens (from any pod: llm-d's mapping is global and survives a clear), with the
  span and parent learned there.
- **BlockRemoved** drops the pod's entries of those hashes on that medium; a hash the pod never
  announced there changes nothing. **AllBlocksCleared** drops every entry of the pod, on every
  medium (llm-d's ``Index.Clear(pod)``); the learned spans and parents stay.
- **Lookup** (llm-d's longest-prefix scorer, one medium at a time): from the prefix's first
  block, an entry counts when it ends on a block of the prefix, covers whole engine blocks from
  where the match stands and names the block before them as its parent; the match moves past
  it. What is credited is the engine blocks so covered.
- **Sequence numbers** (llm-d ignores them; vLLM's replay protocol is there for subscribers
  that do not): in order, apply; a number above the expected one is a gap: replay from the
  expected one; a number not above the last one received live is a new publisher: replay from 0 (the
  restarted publisher's whole buffer, which starts with its ``AllBlocksCleared``). A replay
  that does not start where asked (the buffer no longer holds it) leaves the view unknown:
  :attr:`Subscription.holes` counts it. After each (re)connection, until a live batch arrives,
  the subscriber asks for the publisher's buffer every 0.25 s (a PUB socket drops what it sends
  before the subscription reaches it): a buffer that ends below the last batch applied is a
  new publisher, applied from its start.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvoffload.events import END_SEQ

#: llm-d's medium for an event without one.
DEFAULT_MEDIUM = "gpu"


@dataclass(frozen=True)
class Entry:
    """What a router knows of one announced block hash: the hash it chains from (None: the
    first of a prefix) and the tokens it covers."""

    parent: Any
    tokens: int


def _fields(ev: Any) -> tuple[str, dict[str, Any]]:
    """``(tag, fields by name)`` of one decoded event, array (vLLM's field order) or map."""
    if isinstance(ev, dict):
        return ev.get("type", ""), ev
    if not isinstance(ev, list) or not ev:
        return "", {}
    tag, rest = ev[0], ev[1:]
    if tag == "BlockStored":
        names = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
        names += ("medium", "lora_name", "extra_keys", "group_idx")
    elif tag == "BlockRemoved":
        names = ("block_hashes", "medium", "group_idx")
    else:
        names = ()
    return tag, dict(zip(names, rest))


class RouterIndex:
    """Per pod, per medium: the announced block hashes, applied from event batches.

    Args:
        block_size: the engine's tokens per block (the unit :meth:`lookup` counts in).
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        #: pod -> medium -> block hash -> entry
        self.pods: dict[str, dict[str, dict[Any, Entry]]] = {}
        #: block hash -> entry, learned from events with tokens (any pod; kept through clears)
        self.known: dict[Any, Entry] = {}
        #: events applied, skipped (unknown parent or hash), clears applied
        self.counts = {"stored": 0, "removed": 0, "skipped": 0, "cleared": 0}

    def apply(self, pod: str, payload: bytes) -> None:
        """Apply one batch (the msgpack payload of a message on the engine topic) for ``pod``.

        Raises:
            msgspec.DecodeError: the payload is not msgpack.
        """
        batch = msgspec.msgpack.decode(payload)
        for ev in batch[1]:
            tag, f = _fields(ev)
            if tag == "BlockStored":
                self._stored(pod, f)
            elif tag == "BlockRemoved":
                medium = (f.get("medium") or DEFAULT_MEDIUM).lower()
                entries = self.pods.get(pod, {}).get(medium, {})
                for h in f["block_hashes"]:
                    entries.pop(h, None)
                self.counts["removed"] += 1
            elif tag == "AllBlocksCleared":
                self.pods.pop(pod, None)
                self.counts["cleared"] += 1

    def _stored(self, pod: str, f: dict[str, Any]) -> None:
        medium = (f.get("medium") or DEFAULT_MEDIUM).lower()
        hashes, tokens = f["block_hashes"], f.get("token_ids") or []
        entries = self.pods.setdefault(pod, {}).setdefault(medium, {})
        if not tokens:  # llm-d's device-tier update: known hashes only
            known = [h for h in hashes if h in self.known]
            if not known:
                self.counts["skipped"] += 1
                return
            for h in known:
                entries[h] = self.known[h]
            self.counts["stored"] += 1
            return
        parent = f.get("parent_block_hash")
        if parent is not None and parent not in self.known:
            self.counts["skipped"] += 1  # llm-d: no request key for the parent
            return
        span = f["block_size"]
        if len(tokens) != span * len(hashes):
            self.counts["skipped"] += 1
            return
        for h in hashes:
            entry = Entry(parent, span)
            self.known[h] = entries[h] = entry
            parent = h
        self.counts["stored"] += 1

    def lookup(self, pod: str, prefix: Sequence[Any]) -> dict[str, int]:
        """Engine blocks of ``prefix`` (the engine's block hashes, in order) that the router
        credits ``pod`` with, per medium (lower case); media with none are left out."""
        out = {}
        for medium, entries in self.pods.get(pod, {}).items():
            pos = 0
            while pos < len(prefix):
                before = prefix[pos - 1] if pos else None
                for end in range(pos, len(prefix)):
                    e = entries.get(prefix[end])
                    if e is not None:
                        break
                else:
                    break
                if e.parent != before or e.tokens != (end + 1 - pos) * self.block_size:
                    break
                pos = end + 1
            if pos:
                out[medium] = pos
        return out

    def hashes(self, pod: str, medium: str) -> set[Any]:
        """The block hashes ``pod`` is credited with on ``medium`` (lower case)."""
        return set(self.pods.get(pod, {}).get(medium, {}))


class Subscription:
    """One pod's publisher, subscribed to as a router would: a SUB on ``endpoint`` (engine
    ``topic``), a DEALER on ``replay_endpoint``. Joins by replaying from 0.

    Args:
        index: where batches are applied.
        pod: the pod they are applied for.
        endpoint, replay_endpoint: the publisher's (TCP) endpoints.
        topic: the engine topic (bytes).
        patience_s: upper bound for a replay's answer (seconds; never a measure of speed).
    """

    def __init__(
        self,
        index: RouterIndex,
        pod: str,
        endpoint: str,
        replay_endpoint: str,
        topic: bytes = b"kv-events",
        patience_s: float = 120.0,
    ):
        self.index, self.pod, self.topic = index, pod, topic
        self.replay_endpoint = replay_endpoint
        self.patience_s = patience_s
        self._ctx = zmq.Context()
        self.sub = self._ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sub.connect(endpoint)
        #: catch-up replays are due (monotonic time of the next) until a live batch arrives
        self._catch_up_at: float | None = None
        #: the next sequence number expected (None: none applied yet)
        self.expected: int | None = None
        #: the last sequence number received live
        self.last_live: int | None = None
        #: restarts seen (the sequence went back), gaps replayed, replays that left a hole
        self.restarts = self.gaps = self.holes = 0
        self.replay(0)

    def _fetch(self, start: int) -> list[tuple[int, bytes]]:
        """The publisher's buffered batches of the topic from ``start`` (vLLM's protocol)."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        out = []
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                assert dealer.poll(self.patience_s * 1000), "no replay answer"
                _, topic, seq_bytes, payload = dealer.recv_multipart()
                if seq_bytes == END_SEQ:
                    return out
                if topic == self.topic:
                    out.append((int.from_bytes(seq_bytes, "big"), payload))
        finally:
            dealer.close()

    def replay(self, start: int) -> None:
        """Ask the publisher for its buffered batches from ``start`` and apply them in order
        (those not yet applied)."""
        batches = self._fetch(start)
        if batches and start and batches[0][0] != start:
            self.holes += 1  # the buffer no longer holds what was asked
        for seq, payload in batches:
            if self.expected is None or seq >= self.expected:
                self._take(seq, payload)

    def _catch_up(self) -> None:
        """After a (re)connection, before any live batch: what the publisher sent meanwhile (a
        PUB socket drops what it sends before the subscription reaches it). A buffer that ends
        below the last batch applied is another publisher's: a restart in place."""
        batches = self._fetch(0)
        if not batches:
            return
        if self.expected is not None and batches[-1][0] < self.expected - 1:
            self.restarts += 1
            self.expected = None
        for seq, payload in batches:
            if self.expected is None or seq >= self.expected:
                self._take(seq, payload)

    def _take(self, seq: int, payload: bytes) -> None:
        self.index.apply(self.pod, payload)
        self.expected = seq + 1

    def poll(self) -> int:
        """Apply what arrived (never waits); returns the batches received live."""
        n = 0
        while self._monitor.poll(0):
            recv_monitor_message(self._monitor)
            self._catch_up_at = time.monotonic()
        if self._catch_up_at is not None and time.monotonic() >= self._catch_up_at:
            self._catch_up_at = time.monotonic() + 0.25
            self._catch_up()
        while self.sub.poll(0):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            n += 1
            self._catch_up_at = None
            seq = int.from_bytes(seq_bytes, "big")
            last_live, self.last_live = self.last_live, seq
            if last_live is not None and seq <= last_live:
                # one connection delivers in order: a number not above the last one received
                # live is a new publisher (a restart in place)
                self.restarts += 1
                self.expected = None
                self.replay(0)
            elif self.expected is None or seq == self.expected:
                self._take(seq, payload)
            elif seq > self.expected:
                self.gaps += 1
                self.replay(self.expected)
                if self.expected <= seq:  # the replay did not reach it: apply it now
                    self._take(seq, payload)
            # else: a batch the join's replay already gave
        return n

    def until(self, condition: Callable[[], Any], what: str, step=None) -> Any:
        """Poll (and call ``step``) until ``condition()`` is true (upper bound
        ``patience_s``)."""
        deadline = time.monotonic() + self.patience_s
        while True:
            if step is not None:
                step()
            self.poll()
            value = condition()
            if value:
                return value
            assert time.monotonic() < deadline, (
                f"timed out waiting for {what} (expected {self.expected}, last live "
                f"{self.last_live}, restarts {self.restarts}, gaps {self.gaps}, holes "
                f"{self.holes}, index {self.index.counts})"
            )
            time.sleep(0.005)

    def close(self) -> None:
        self.sub.disable_monitor()
        self._monitor.close()
        self.sub.close()
        self._ctx.term()
