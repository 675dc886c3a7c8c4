"""Where chunks are (issue 12, CASES C18): PeerLocations learns from real peers' KV events which
peer holds which chunk, in its host tier or its own fs tier. Real tiering managers publish (real
arenas, real fs tier workers, real ZMQ sockets on loopback); a lossy forwarder between a publisher
and the subscriber makes gaps where a test needs one. Every wait is for a condition."""

from __future__ import annotations

import contextlib
import time

import msgspec
import pytest
import zmq
from helpers import ROW, arena_name, fs_tier, keys_for, namespace, vllm_installed, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st
from zmq.utils.monitor import recv_monitor_message

from kvoffload.config import ConfigError, parse_config
from kvoffload.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ChunkEventInfo,
    KVEventBatch,
)
from kvoffload.ipc.arena import Arena
from kvoffload.tiering import TieringManager
from kvoffload.tiers.p2p.locations import PeerLocations, PeerLocationsConfig, event_sources
from kvoffload.tools.ports import free_port
from kvoffload.validation import convert
from kvoffload.workers.chunkfile import HEADER_BYTES

FB = HEADER_BYTES + ROW  # bytes of one chunk file
TPC = 16  # tokens per chunk of the test namespace
A, B = "node-a:5710", "node-b:5710"


def _kv_events(replay: bool = True) -> dict:
    """A publisher's ``kv_events`` on fixed free ports (a restarted peer binds them again)."""
    cfg = {"endpoint": f"tcp://127.0.0.1:{free_port()}"}
    if replay:
        cfg["replay_endpoint"] = f"tcp://127.0.0.1:{free_port()}"
    return cfg


def _source(kv_events: dict) -> dict:
    """The ``peer_events`` entry of a peer publishing with ``kv_events``."""
    return {k: v for k, v in kv_events.items() if k in ("endpoint", "replay_endpoint")}


class Peer:
    """One publishing instance: arena, tiering manager (fs tier optional), KV events.

    ``event_block_hash``: the manager's ``key -> published hash`` (vLLM passes its converter)."""

    def __init__(
        self,
        kv_events: dict,
        *,
        num_slots: int = 8,
        fs_root=None,
        fs_files: int = 1000,
        ns=None,
        event_block_hash=None,
    ):
        tiers = [fs_tier(fs_root, max_bytes=fs_files * FB)] if fs_root is not None else []
        config = parse_config(
            {"cpu_bytes_to_use": num_slots * ROW, "secondary_tiers": tiers, "kv_events": kv_events}
        )
        self.arena = Arena.create(arena_name(), num_slots, ROW)
        try:
            self.tm = TieringManager(
                self.arena, ns or namespace(), config, event_block_hash=event_block_hash
            )
        except BaseException:
            self.arena.close()
            raise
        self.closed = False

    def store(self, keys, info=None) -> None:
        """Store ``keys`` (one batch of a request that then finishes, as under vLLM), write them
        through, publish the step's events."""
        tm = self.tm
        self.requests = getattr(self, "requests", 0) + 1
        req = f"req-{self.requests}"
        plan = tm.prepare_store(list(keys), req, *([info] if info is not None else []))
        assert plan is not None and list(plan.keys) == list(keys)
        for s in plan.slots:
            self.arena.rows[s] = 7
        tm.complete_store(plan.keys, True, req)
        tm.on_request_finished(req)
        assert tm.wait_idle(120), "tier jobs did not finish"
        self.publish()

    def publish(self) -> None:
        self.tm.step()
        assert self.tm.publisher is not None and self.tm.publisher.flush()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.tm.shutdown()
            self.arena.close()


@pytest.fixture
def make():
    """Builds peers and PeerLocations; closes them all at the end."""
    made: list = []

    class Make:
        @staticmethod
        def peer(*args, **kwargs) -> Peer:
            p = Peer(*args, **kwargs)
            made.append(p)
            return p

        @staticmethod
        def locations(sources: dict, confirm=None, **kwargs) -> PeerLocations:
            """PeerLocations over ``sources``; the peers in ``confirm`` (default: all) are
            confirmed, as the p2p node does once their sessions are welcomed."""
            kwargs.setdefault("tokens_per_chunk", TPC)
            loc = PeerLocations(sources, **kwargs)
            made.append(loc)
            for peer in sources if confirm is None else confirm:
                loc.confirm_peer(peer)
            return loc

    yield Make
    for x in reversed(made):
        x.close()


def until(loc: PeerLocations, condition, what: str):
    """Poll ``loc`` until ``condition()`` holds (generous upper bound, never the thing tested)."""
    return wait_until(condition, what=what, step=loc.poll)


def caught_up(loc: PeerLocations, *peers: Peer) -> None:
    """Until ``loc`` has applied every batch ``peers`` published (each exactly once, live or
    replayed), so what it says can be asserted."""
    published = sum(p.tm.publisher.published["engine"] for p in peers)
    until(loc, lambda: loc.counts["batches"] == published, f"{published} batches applied")


def synced(loc: PeerLocations, peer: Peer, name: str, seed: int = 900) -> list[bytes]:
    """Store probe chunks on ``peer`` until ``loc`` has located the last one stored (a feed
    without a replay endpoint learns only what is published after its SUB socket has
    subscribed, which a PUB socket does not tell). Then nothing published is still on its way.
    Returns the probes stored."""
    deadline = time.monotonic() + 120
    stored: list[bytes] = []
    for k in keys_for(10_000, seed=seed):
        peer.store([k])
        stored.append(k)
        again = time.monotonic() + 0.2  # then probe again (the last probe may have been lost)
        while time.monotonic() < again:
            loc.poll()
            if name in loc.places(k):
                return stored
            time.sleep(0.005)
        assert time.monotonic() < deadline, f"{name}'s events never arrived"
    raise AssertionError("out of probes")


# -- C18: a chunk in a peer's fs tier is still located there -------------------------------------


def test_c18_a_chunk_spilled_to_a_peers_fs_tier_stays_located_until_it_leaves_every_tier(
    tmp_path, make
):
    """A has 2 host slots and an fs tier of 3 files. K1, K2, K3 stored: K1 leaves A's host tier
    but is still in its fs tier, so A is still where K1 is (as fs), and where K3 is (host first);
    K4 stored: K1 leaves the fs tier too and nobody holds it any more."""
    ev = _kv_events()
    a = make.peer(ev, num_slots=2, fs_root=tmp_path / "a", fs_files=3)
    loc = make.locations({A: _source(ev)})
    k1, k2, k3, k4 = keys_for(4)
    for k in (k1, k2, k3):
        a.store([k])
    caught_up(loc, a)
    assert loc.places(k3) == {A: ["host", "fs"]} and loc.places(k1) == {A: ["fs"]}
    assert loc.where(k1) == [A] and loc.where(k3) == [A]
    a.store([k4])
    caught_up(loc, a)
    assert loc.places(k1) == {} and loc.where(k1) == []
    assert loc.places(k2) == {A: ["fs"]} and loc.where(k2) == [A]
    assert loc.counts["malformed"] == loc.counts["lost"] == 0


def test_where_names_host_holders_before_fs_holders_and_only_confirmed_peers(tmp_path, make):
    """K in A's fs tier only and in B's host tier: B comes first although A is configured
    first. A peer whose namespace the p2p node has not confirmed is never named, though its
    events are kept; confirmed, it is."""
    ev_a, ev_b = _kv_events(), _kv_events()
    a = make.peer(ev_a, num_slots=2, fs_root=tmp_path / "a")
    b = make.peer(ev_b, num_slots=8)
    # B not confirmed (yet): as before the p2p node's session with B is welcomed
    loc = make.locations({A: _source(ev_a), B: _source(ev_b)}, confirm=[A])
    k, x, y = keys_for(3)
    a.store([k])
    a.store([x])
    a.store([y])  # K leaves A's host tier (2 slots), stays in A's fs tier
    b.store([k])
    until(loc, lambda: loc.places(k) == {A: ["fs"], B: ["host"]}, "K in A's fs and B's host")
    assert loc.where(k) == [A] and not loc.confirmed(B)
    loc.confirm_peer(B)
    assert loc.where(k) == [B, A]
    assert loc.where(y) == [A]
    assert loc.where(keys_for(1, seed=5)[0]) == []


def test_a_reset_forgets_a_peers_host_tier_but_not_its_fs_tier(tmp_path, make):
    ev = _kv_events()
    a = make.peer(ev, num_slots=8, fs_root=tmp_path / "a")
    loc = make.locations({A: _source(ev)})
    keys = keys_for(3)
    a.store(keys)
    until(loc, lambda: all(loc.places(k) == {A: ["host", "fs"]} for k in keys), "K1..K3 stored")
    a.tm.reset_cache()
    a.publish()
    until(loc, lambda: all(loc.places(k) == {A: ["fs"]} for k in keys), "host tier cleared")
    assert [loc.where(k) for k in keys] == [[A]] * 3


# -- chunk keys in events --------------------------------------------------------------------------


def test_a_chunk_of_several_blocks_is_located_by_its_last_block(make):
    """Under vLLM a chunk's BlockStored lists the engine hashes of all its blocks and its key is
    the last block's hash plus the 4-byte group index: 4 blocks of 4 tokens per chunk here. Only
    the chunk's last block is located; its removal (all its blocks listed) forgets it."""
    ev = _kv_events()
    a = make.peer(ev, num_slots=2)
    loc = make.locations({A: _source(ev)})
    blocks = [bytes([i]) * 32 for i in range(1, 13)]  # 3 chunks of 4 engine blocks
    keys = [blocks[i + 3] + (0).to_bytes(4, "big") for i in (0, 4, 8)]
    info = {
        k: ChunkEventInfo(
            block_hashes=blocks[4 * i : 4 * i + 4],
            parent_block_hash=blocks[4 * i - 1] if i else None,
            token_ids=list(range(16 * i, 16 * i + 16)),
            block_size=4,
            group_idx=0,
        )
        for i, k in enumerate(keys)
    }
    a.store(keys[:2], info)
    until(loc, lambda: loc.where(keys[0]) == loc.where(keys[1]) == [A], "both chunks located")
    assert loc.located_chunks(A) == 2  # the chunks' last blocks, not their 8 blocks
    a.store(keys[2:], info)  # 2 host slots: the first batch's tail is evicted (C47)
    until(loc, lambda: loc.where(keys[1]) == [] and loc.where(keys[2]) == [A], "K2 evicted")
    assert loc.located_chunks(A) == 2 and loc.counts["mismatched"] == 0


@pytest.mark.skipif(not vllm_installed(), reason="needs vLLM (the vllm extra)")
def test_a_chunk_published_with_vllms_block_hash_is_located_by_its_key(make):
    """Under vLLM a chunk stored without its request's values (a promotion) is published with
    vLLM's converter of the key (the block hash without the group suffix, by default its low 64
    bits as an int): found by the key with no converter configured."""
    from kvoffload.vllm.compat import event_block_hash

    ev = _kv_events()
    a = make.peer(ev, num_slots=4, event_block_hash=event_block_hash)
    loc = make.locations({A: _source(ev)})
    keys = [bytes([i]) * 32 + (0).to_bytes(4, "big") for i in (1, 2)]
    a.store(keys)
    caught_up(loc, a)
    assert [loc.where(k) for k in keys] == [[A], [A]]


def test_events_of_another_chunk_size_are_counted_and_never_located(make):
    """A peer of 32-token chunks publishes chunks whose events cannot be ours (16 tokens)."""
    ev = _kv_events()
    a = make.peer(ev, num_slots=4, ns=namespace(tokens_per_chunk=32))
    loc = make.locations({A: _source(ev)})
    k = keys_for(1, tokens_per_chunk=32)[0]
    a.store([k])
    until(loc, lambda: loc.counts["mismatched"] >= 1, "the event counted as mismatched")
    assert loc.where(k) == [] and loc.located_chunks(A) == 0


def test_a_full_feed_forgets_its_least_recently_stored_chunks(make):
    ev = _kv_events()
    a = make.peer(ev, num_slots=64)
    loc = make.locations({A: _source(ev)}, max_chunks_per_peer=4)
    # the feed is live first (chunks stored before its SUB socket subscribed would never come)
    probes = synced(loc, a, A)
    keys = keys_for(10)
    for k in keys:
        a.store([k])
    until(loc, lambda: loc.where(keys[-1]) == [A], "the last chunk located")
    assert [k for k in keys if loc.where(k)] == keys[-4:]
    assert not [k for k in probes if loc.where(k)]
    assert loc.located_chunks(A) == 4
    assert loc.counts["evicted"] == len(probes) + len(keys) - 4


def test_int_block_hashes_are_located_with_the_publishers_converter(make):
    """Peers publishing vLLM's int hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): ``block_hash``
    gives the same converter the publishers use."""

    def to_int(key: bytes) -> int:
        return int.from_bytes(key[-12:-4], "big")

    ev = _kv_events()
    a = make.peer(ev, num_slots=4, event_block_hash=to_int)
    loc = make.locations({A: _source(ev)}, block_hash=to_int)
    k = keys_for(1)[0]
    a.store([k])
    until(loc, lambda: loc.where(k) == [A], "the chunk located by its int hash")


# -- sequence numbers: restarts, gaps, replays, drop_peer -------------------------------------------


def _wait_reconnected(monitor: zmq.Socket, what: str) -> None:
    """Until the monitored socket has completed a handshake with its peer again."""
    assert monitor.poll(120_000), f"no reconnection of {what}"
    while True:
        msg = recv_monitor_message(monitor)
        if msg["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return
        assert monitor.poll(120_000), f"no reconnection of {what}"


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
def test_a_restarted_peer_is_a_new_publisher_and_its_old_locations_are_dropped(make, replay):
    """A publishes 20 batches, then restarts on the same endpoints: its new publisher numbers
    from 0 again, so what the old one said is dropped, and what the new one says is learned."""
    ev = _kv_events(replay)
    a = make.peer(ev, num_slots=64)
    loc = make.locations({A: _source(ev)})
    # With a replay endpoint too: the feed's replay from 0 at start may run before A publishes,
    # and batches published before the SUB socket has subscribed are lost with no later batch to
    # show the gap (a PUB socket drops them silently), so the old chunks would never be located.
    synced(loc, a, A)
    old = keys_for(20)
    for k in old:
        a.store([k])
    until(loc, lambda: all(loc.where(k) == [A] for k in old), "A's chunks located")
    sub = loc.sockets[0]
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        a.close()
        a2 = make.peer(ev, num_slots=64)
        _wait_reconnected(monitor, "the SUB socket to A's new publisher")
    finally:
        sub.disable_monitor()
        monitor.close()
    synced(loc, a2, A, seed=901)
    until(loc, lambda: not any(loc.where(k) for k in old), "A's old chunks dropped")
    assert loc.counts["restarts"] >= 1
    k = keys_for(1, seed=902)[0]
    a2.store([k])
    until(loc, lambda: loc.where(k) == [A], "a chunk of the new publisher located")


class LossyForwarder:
    """Forwards a publisher's batches to a subscriber, dropping those it is told to: the SUB
    socket side of a network that loses messages. Its XPUB tells when the subscriber is in."""

    def __init__(self, endpoint: str, topic: bytes = b"kv-events", bind: str | None = None):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = bind or f"tcp://127.0.0.1:{free_port()}"
        self.pub.bind(self.endpoint)
        self.seen: set[bytes] = set()  # the chunks of the batches received (forwarded or not)

    def wait_subscriber(self) -> None:
        assert self.pub.poll(120_000), "the subscriber never subscribed"
        assert self.pub.recv()[0] == 1

    def pump(self, drop: bytes | None = None) -> None:
        """Forward every batch received, except the one storing chunk ``drop`` (the run's
        opening ``AllBlocksCleared``, which names no chunk, is forwarded when it is received)."""
        while self.sub.poll(0):
            frames = self.sub.recv_multipart()
            first = msgspec.msgpack.decode(frames[2], type=KVEventBatch).events[0]
            if not hasattr(first, "block_hashes"):
                self.pub.send_multipart(frames)
                continue
            key = first.block_hashes[0]
            self.seen.add(key)
            if key != drop:
                self.pub.send_multipart(frames)

    def close(self) -> None:
        self.sub.close()
        self.pub.close()
        self.ctx.term()


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
def test_a_lost_batch_is_replayed_or_the_peers_locations_are_dropped(make, replay):
    """K1, K2, K3 in three batches; the batch of K2 is lost on the way. With the peer's replay
    endpoint the gap is filled from its buffer (all three located); without it, what the feed
    knew before the gap is dropped (K1 forgotten, K3 located)."""
    ev = _kv_events(replay=True)
    a = make.peer(ev, num_slots=64)
    fwd = LossyForwarder(ev["endpoint"])
    try:
        source = {"endpoint": fwd.endpoint}
        if replay:
            source["replay_endpoint"] = ev["replay_endpoint"]
        loc = make.locations({A: source}, replay_timeout_s=60)
        fwd.wait_subscriber()
        probes = iter(keys_for(1000, seed=903))
        stored: list[bytes] = []

        def probe():  # until the forwarder's own SUB socket gets the publisher's batches
            if not fwd.seen:
                stored.append(next(probes))
                a.store(stored[-1:])
            fwd.pump()
            loc.poll()

        wait_until(
            lambda: fwd.seen and all(loc.where(k) for k in fwd.seen),
            what="the forwarder subscribed, every probe it received located",
            step=probe,
        )
        gaps = loc.counts["gaps"]
        k1, k2, k3 = keys_for(3)
        for k in (k1, k2, k3):
            a.store([k])
            wait_until(
                lambda: k in fwd.seen,  # noqa: B023 - called in this iteration only
                what="the batch at the forwarder",
                step=lambda: fwd.pump(drop=k2),
            )
        until(loc, lambda: loc.where(k3) == [A], "K3 located")
        assert loc.counts["gaps"] == gaps + 1
        if replay:
            assert loc.where(k1) == loc.where(k2) == [A]
            assert loc.counts["lost"] == 0
        else:
            assert loc.where(k1) == loc.where(k2) == []
            assert loc.counts["lost"] == 1
    finally:
        fwd.close()


def test_a_burst_published_while_the_subscription_joins_is_caught_up_without_a_later_batch(make):
    """The peer publishes right after the subscriber's first replay ended but before its SUB
    socket's subscription reached the PUB socket (which drops the batch), then goes quiet: no
    later batch shows a gap. The feed asks again (a catch-up replay) until its first live batch,
    so the chunk is located anyway."""
    ev = _kv_events()
    a = make.peer(ev, num_slots=16)
    joining = f"tcp://127.0.0.1:{free_port()}"  # the SUB socket's way in: not there yet
    loc = make.locations({A: {"endpoint": joining, "replay_endpoint": ev["replay_endpoint"]}})
    until(loc, lambda: loc.counts["replays"] >= 1 and not loc.replaying(A), "the first replay")
    k = keys_for(1, seed=31)[0]
    a.store([k])  # no subscriber at the PUB socket: the live batch is dropped
    fwd = LossyForwarder(ev["endpoint"], bind=joining)  # the subscription reaches it now
    try:
        fwd.wait_subscriber()
        until(loc, lambda: loc.where(k) == [A], "the quiet peer's chunk located")
        assert loc.counts["catch_ups"] >= 1 and loc.counts["gaps"] == 0
        assert loc.counts["messages"] == 0  # nothing came live: the replay found it
    finally:
        fwd.close()


def test_drop_peer_forgets_its_locations_and_relearns_them_from_its_replay(make):
    ev = _kv_events()
    a = make.peer(ev, num_slots=16)
    loc = make.locations({A: _source(ev)})
    keys = keys_for(3)
    a.store(keys)
    until(loc, lambda: all(loc.where(k) == [A] for k in keys), "A's chunks located")
    loc.drop_peer(A)  # marked down, or back with a new incarnation
    assert not loc.confirmed(A) and loc.located_chunks(A) == 0
    assert [loc.where(k) for k in keys] == [[]] * 3
    loc.confirm_peer(A)  # its session is welcomed again
    until(loc, lambda: all(loc.where(k) == [A] for k in keys), "A's chunks relearned")


def test_drop_peer_without_replay_learns_only_what_comes_next(make):
    ev = _kv_events(replay=False)
    a = make.peer(ev, num_slots=64)
    loc = make.locations({A: _source(ev)})
    old = synced(loc, a, A)
    loc.drop_peer(A)
    loc.confirm_peer(A)
    new = keys_for(1, seed=7)[0]
    a.store([new])
    until(loc, lambda: loc.where(new) == [A], "the next chunk located")
    assert not any(loc.where(k) for k in old)


def test_a_replay_endpoint_that_never_answers_is_abandoned_and_live_batches_still_count(make):
    """The configured replay endpoint has nothing behind it: the replay asked at the start is
    abandoned after ``replay_timeout_s`` and the live batches buffered meanwhile are applied."""
    ev = _kv_events(replay=False)
    a = make.peer(ev, num_slots=64)
    dead = f"tcp://127.0.0.1:{free_port()}"
    loc = make.locations({A: {**_source(ev), "replay_endpoint": dead}}, replay_timeout_s=0.2)
    synced(loc, a, A)
    assert loc.counts["replay_failures"] >= 1
    k = keys_for(1, seed=8)[0]
    a.store([k])
    until(loc, lambda: loc.where(k) == [A], "a later chunk located")


# -- what a feed may say --------------------------------------------------------------------------


class FakePublisher:
    """An XPUB that sends what a test hands it (real frames, encoded with the publisher's own
    structs or not at all), and a ROUTER that answers replay requests as told."""

    def __init__(self, topic: bytes = b"kv-events"):
        self.ctx = zmq.Context()
        self.topic = topic
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.pub.bind(self.endpoint)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.router.bind(self.replay_endpoint)
        self.client: bytes | None = None
        self.seq = 0

    def source(self, replay: bool = True) -> dict:
        return {
            "endpoint": self.endpoint,
            **({"replay_endpoint": self.replay_endpoint} if replay else {}),
        }

    def wait_subscriber(self) -> None:
        assert self.pub.poll(120_000), "the subscriber never subscribed"
        assert self.pub.recv()[0] == 1

    def requests(self, wait: bool = False) -> list[int]:
        """Replay requests received (their start numbers); remembers the asking DEALER."""
        out = []
        if wait:
            assert self.router.poll(120_000), "no replay request"
        while self.router.poll(0):
            frames = self.router.recv_multipart()
            self.client = frames[0]
            out.append(int.from_bytes(frames[-1], "big"))
        return out

    def answer(self, *frames_list) -> None:
        for frames in frames_list:
            self.router.send_multipart([self.client, *frames])

    def send(self, events: list, seq: int | None = None) -> bytes:
        payload = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events))
        self.send_frames(
            [self.topic, (self.seq if seq is None else seq).to_bytes(8, "big"), payload]
        )
        self.seq = (self.seq if seq is None else seq) + 1
        return payload

    def send_frames(self, frames) -> None:
        self.pub.send_multipart(frames)

    def close(self) -> None:
        self.pub.close()
        self.router.close()
        self.ctx.term()


def stored(*hashes, medium="CPU", ownership=None, block_size=TPC) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[],
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
        ownership=ownership,
    )


@pytest.fixture
def fake():
    f = FakePublisher()
    yield f
    f.close()


def test_only_servable_places_count_and_all_blocks_cleared_forgets_the_feed(make, fake):
    """GPU (the device cache), PEER (chunks a peer pushed to others) and no medium are not
    servable by the peer; a memory tier (medium CPU, owned by a tier) is a secondary place."""
    loc = make.locations({A: fake.source(replay=False)})
    fake.wait_subscriber()
    h = [bytes([i]) * 20 for i in range(6)]
    fake.send(
        [
            stored(h[0], medium="GPU"),
            stored(h[1], medium="PEER", ownership="p2p"),
            stored(h[2], medium=None),
            stored(h[3], medium="CPU", ownership="memory"),
            stored(h[4], h[5]),
            BlockRemoved(block_hashes=[h[5]], medium="CPU"),
        ]
    )
    until(loc, lambda: loc.counts["batches"] == 1, "the batch applied")
    assert [loc.where(x) for x in h] == [[], [], [], [A], [A], []]
    assert loc.places(h[3]) == {A: ["memory"]} and loc.places(h[4]) == {A: ["host"]}
    fake.send([AllBlocksCleared()])
    until(loc, lambda: loc.counts["batches"] == 2, "the clear applied")
    assert loc.located_chunks(A) == 0


def test_a_late_live_batch_already_replayed_is_not_a_restart(make, fake):
    """The replay gives batches 0-2; batch 2 then arrives live too (the PUB connection was
    slower than the replay's): a duplicate, ignored, and nothing is dropped."""
    h = [bytes([i]) * 20 for i in range(4)]
    loc = make.locations({A: fake.source()})
    fake.wait_subscriber()
    assert fake.requests(wait=True) == [0]
    payloads = [msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[stored(x)])) for x in h]
    fake.answer(
        *([b"", b"kv-events", i.to_bytes(8, "big"), payloads[i]] for i in range(3)),
        [b"", b"", END_SEQ, b""],
    )
    until(
        loc,
        lambda: loc.counts["replayed_batches"] == 3 and not loc.replaying(A),
        "the replay applied and ended",
    )

    def catch_ups():  # answered: nothing more buffered (a live batch may arrive meanwhile)
        for _ in fake.requests():
            fake.answer([b"", b"", END_SEQ, b""])
        loc.poll()

    fake.send_frames([b"kv-events", (2).to_bytes(8, "big"), payloads[2]])
    fake.send_frames([b"kv-events", (3).to_bytes(8, "big"), payloads[3]])
    wait_until(lambda: loc.where(h[3]) == [A], what="batch 3 applied", step=catch_ups)
    assert [loc.where(x) for x in h] == [[A]] * 4
    assert loc.counts["duplicates"] == 1 and loc.counts["restarts"] == 0


# -- config ----------------------------------------------------------------------------------------


def test_peer_events_config_shapes_and_errors():
    cfg = convert(
        {
            "peer_events": {
                "node-b:5710": "tcp://node-b:5557",
                "node-c:5710": {
                    "endpoint": "tcp://node-c:5557",
                    "replay_endpoint": "tcp://node-c:5558",
                },
                "node-d:5710": [
                    "tcp://node-d:5557",
                    {"endpoint": "tcp://node-d:5559", "topic": "t"},
                ],
            },
            "max_located_chunks": 1000,
        },
        PeerLocationsConfig,
        "p2p",
    )
    sources = event_sources(cfg.peer_events, "p2p.peer_events")
    assert [len(v) for v in sources.values()] == [1, 1, 2]
    assert sources["node-c:5710"][0].replay_endpoint == "tcp://node-c:5558"
    assert sources["node-d:5710"][1].topic == "t" and sources["node-b:5710"][0].topic == "kv-events"
    bad = [
        ({"peer_events": {"node-b": "tcp://b:1"}}, "'node-b'.*host:port"),
        ({"peer_events": {"b:1": "http://b:1"}}, r"'b:1'.*not a ZMQ endpoint"),
        ({"peer_events": {"b:1": []}}, "no event endpoint"),
        ({"peer_events": {"b:1": {"endpont": "tcp://b:1"}}}, "endpont"),
        ({"peer_events": {"b:1": "tcp://x:1", "c:1": "tcp://x:1"}}, "also given"),
        ({"replay_timeout_s": 0}, "replay_timeout_s"),
        ({"max_located_chunks": 0}, "max_located_chunks"),
    ]
    for raw, match in bad:
        with pytest.raises(ConfigError, match=match):
            convert(raw, PeerLocationsConfig, "p2p")


def test_an_endpoint_zmq_cannot_connect_to_is_a_config_error_naming_the_peer():
    with pytest.raises(ConfigError, match=r"p2p.peer_events\['b:1'\].endpoint.*tcp://nohost"):
        PeerLocations({"b:1": "tcp://nohost"}, tokens_per_chunk=TPC, where="p2p.peer_events")


# -- fuzz ------------------------------------------------------------------------------------------

_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=24),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_events = st.fixed_dictionaries(
    {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])},
    optional={
        "block_hashes": st.lists(
            st.binary(max_size=24) | st.integers(-5, 2**64 - 1) | st.text(max_size=3), max_size=6
        ),
        "parent_block_hash": st.none() | st.binary(max_size=8),
        "token_ids": st.lists(st.integers(0, 100), max_size=8),
        "block_size": st.integers(-4, 64),
        "lora_id": st.none(),
        "lora_name": st.none(),
        "medium": st.sampled_from([None, "CPU", "GPU", "STORAGE", "PEER", ""]),
        "ownership": st.none() | st.sampled_from(["fs", "obj", ""]),
        "group_idx": st.none() | st.integers(-1, 3),
    },
)
_payloads = (
    st.binary(max_size=64)
    | _msgpack_values.map(msgspec.msgpack.encode)
    | st.tuples(
        st.floats(allow_nan=False), st.lists(_events, max_size=4), st.none() | st.integers(0, 3)
    ).map(lambda t: msgspec.msgpack.encode(list(t)))
)
_seqs = st.integers(0, 12).map(lambda n: n.to_bytes(8, "big")) | st.binary(max_size=10)
_live = st.one_of(
    st.tuples(st.just(b"kv-events"), _seqs, _payloads).map(list),
    st.lists(st.binary(max_size=16), min_size=0, max_size=4).map(
        lambda rest: [b"kv-events", *rest]
    ),
    st.tuples(st.just(b"kv-events-other"), _seqs, _payloads).map(list),
)
_answers = st.one_of(
    st.tuples(st.just(b""), st.just(b"kv-events"), _seqs, _payloads).map(list),
    st.just([b"", b"", END_SEQ, b""]),
    st.lists(st.binary(max_size=16), min_size=1, max_size=5),
)


@pytest.fixture(scope="module")
def fuzzed():
    f = FakePublisher()
    loc = PeerLocations(
        {A: f.source()},
        tokens_per_chunk=TPC,
        replay_timeout_s=0.01,
        max_buffered_batches=3,
        max_chunks_per_peer=8,
    )
    try:
        loc.confirm_peer(A)
        f.wait_subscriber()
        f.requests(wait=True)
        yield f, loc
    finally:
        loc.close()
        f.close()


@settings(max_examples=200, deadline=None)
@given(live=st.lists(_live, max_size=6), answers=st.lists(_answers, max_size=6))
def test_malformed_frames_are_counted_and_never_crash(fuzzed, live, answers):
    """Any frames on the SUB socket and any answers on the replay socket: poll() never raises,
    shapes that cannot be a message are counted, the cap holds, and afterwards drop_peer plus a
    good batch gives a correct answer again."""
    fake, loc = fuzzed
    before = dict(loc.counts)
    fake.requests()
    if fake.client is not None:
        fake.answer(*answers)
    for frames in live:
        fake.send_frames(frames)
    until(loc, lambda: loc.counts["messages"] - before["messages"] == len(live), "every message")
    bad_shape = sum(1 for f in live if f[0] == b"kv-events" and (len(f) != 3 or len(f[1]) != 8))
    assert loc.counts["malformed"] - before["malformed"] >= bad_shape
    assert loc.located_chunks(A) <= 8
    assert all(isinstance(loc.where(bytes([i]) * 20), list) for i in range(4))
    # a clean start: forget, replay from 0 (answered: nothing buffered), one good batch
    loc.drop_peer(A)
    loc.confirm_peer(A)
    fake.requests()
    fake.answer([b"", b"", END_SEQ, b""])  # or the replay times out: either way it ends
    good = bytes([9]) * 20
    fake.send([stored(good)], seq=0)
    until(loc, lambda: loc.where(good) == [A], "the good batch applied")
    with contextlib.suppress(zmq.Again):
        fake.router.recv_multipart(zmq.NOBLOCK)
