"""Host and tier events as vLLM's KV-event types, for kvoffload's own publisher.

kvoffload publishes in vLLM's wire format (``BlockStored`` / ``BlockRemoved`` of
:mod:`kvoffload.events`, field for field those of ``vllm/distributed/kv_events.py``), with a
``medium`` per tier (``CPU`` for the host tier), the tier's ``locality`` and ``ownership`` (the
secondary tier's name). :class:`KVEventTranslator` turns the tiering manager's
:class:`~kvoffload.tiers.base.TierEvent` s into those events and keeps what callers told
:meth:`~kvoffload.tiering.TieringManager.prepare_store` about each chunk
(:class:`~kvoffload.events.ChunkEventInfo`) while the chunk is in the host tier, so a chunk's
``BlockStored`` carries the engine's own block hashes, parent hash and token ids (DESIGN.md §4,
"Event content").

Part of the core, not of the vLLM plug-in: it imports no vLLM, and the publisher speaks vLLM's
format standalone too (``kvoffload stress`` with ``kv_events``). :mod:`kvoffload.vllm.kv_events`
re-exports it under its former name.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from kvoffload.events import BlockRemoved, BlockStored, ChunkEventInfo, EventPublisher, Movement
from kvoffload.tiers.base import RoutedTier, SecondaryTierManager, TierEvent


class KVEventTranslator:
    """Tier events → vLLM's ``BlockStored`` / ``BlockRemoved`` (engine thread only).

    Args:
        media: tier name → the ``medium`` its events carry (``"CPU"`` for the host tier).
        localities: tier name → ``"local"`` / ``"remote"`` (published upper case).
        host: the host tier's name in events (its events carry no ``ownership``).
        block_size: tokens per chunk: the ``block_size`` of a chunk published without a
            :class:`~kvoffload.events.ChunkEventInfo`.
        block_hash: ``key -> block hash`` published for such a chunk and in removals (default:
            the key itself, bytes).
        max_infos: how many chunk infos to keep at most before dropping those of chunks no longer
            in the host tier (twice the host tier's slots).
    """

    def __init__(
        self,
        *,
        media: Mapping[str, str],
        localities: Mapping[str, str],
        host: str,
        block_size: int,
        block_hash: Callable[[bytes], Any] | None = None,
        max_infos: int,
    ):
        self.media = dict(media)
        self.localities = {name: loc.upper() for name, loc in localities.items()}
        self.host = host
        self.block_size = block_size
        self.block_hash = block_hash
        self.max_infos = max_infos
        # What callers told prepare_store about each chunk, kept while the chunk is in the host
        # tier: tier stores pin its slot, so their events come first.
        self.infos: dict[bytes, ChunkEventInfo] = {}

    def remember(self, keys: Iterable[bytes], chunk_info: Any) -> None:
        """Keep the :class:`~kvoffload.events.ChunkEventInfo` of each of ``keys`` that
        ``chunk_info.get(key)`` gives (a dict, or a lazy view computed per key)."""
        infos = self.infos
        for k in keys:
            info = chunk_info.get(k)
            if info is not None:
                infos[k] = info

    def forget(self, keys: Iterable[bytes], held: Collection[bytes]) -> None:
        """Drop the infos of ``keys`` not in ``held`` (the host tier's keys): their store failed."""
        if self.infos:
            for k in keys:
                if k not in held:
                    self.infos.pop(k, None)

    def translate(
        self, got: Sequence[tuple[str, TierEvent]], held: Collection[bytes]
    ) -> list[BlockStored | BlockRemoved]:
        """The vLLM events of ``(tier name, event)`` pairs, in order. A key with a chunk info gets
        its own event, chunk-granular (CASES C53): one hash, the engine's hash of the chunk's
        last block (what a lookup finds the chunk by), the parent hash of its first block, its
        token ids and ``block_size`` the chunk's token count (blocks per chunk x the engine
        block size), so no router credits a part of a chunk; with one block per chunk this is
        the engine's own event for the block. The keys of one tier event without an info share a
        plain event (the key's block hash, no parent, no tokens, ``block_size`` the chunk's
        token count). ``held``: the host tier's keys after these events (the infos of chunks
        that left it are dropped)."""
        infos = self.infos
        hash_of = self.block_hash
        out: list[BlockStored | BlockRemoved] = []
        left_host: list[bytes] = []
        for name, ev in got:
            medium = self.media[name]
            locality = self.localities[name]
            owner = None if name == self.host else name
            plain = ev.keys  # keys without a ChunkEventInfo share one event
            if infos:
                plain = []
                for k in ev.keys:
                    info = infos.get(k)
                    if info is None:
                        plain.append(k)
                    elif ev.removed:
                        out.append(
                            BlockRemoved(
                                block_hashes=info.block_hashes[-1:],
                                medium=medium,
                                group_idx=info.group_idx,
                                locality=locality,
                                ownership=owner,
                            )
                        )
                    else:
                        out.append(
                            BlockStored(
                                block_hashes=info.block_hashes[-1:],
                                parent_block_hash=info.parent_block_hash,
                                token_ids=info.token_ids,
                                block_size=info.block_size * len(info.block_hashes),
                                lora_id=None,
                                medium=medium,
                                lora_name=None,
                                group_idx=info.group_idx,
                                locality=locality,
                                ownership=owner,
                            )
                        )
                if ev.removed and name == self.host:
                    left_host.extend(ev.keys)
            hashes = list(plain) if hash_of is None else [hash_of(k) for k in plain]
            if not hashes:
                continue
            if ev.removed:
                out.append(
                    BlockRemoved(
                        block_hashes=hashes, medium=medium, locality=locality, ownership=owner
                    )
                )
            else:
                out.append(
                    BlockStored(
                        block_hashes=hashes,
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=self.block_size,
                        lora_id=None,
                        medium=medium,
                        lora_name=None,
                        locality=locality,
                        ownership=owner,
                    )
                )
        for (
            k
        ) in left_host:  # after the whole batch: a tier's store of a key may follow its eviction
            if k not in held:
                infos.pop(k, None)
        if len(infos) > self.max_infos:
            # bound it whatever happened (a cleared host tier, a store never completed)
            self.infos = {k: v for k, v in infos.items() if k in held}
        return out


class EventStream:
    """The tiering manager's events: what its host tier and tiers report, kept for
    :meth:`take` (vLLM's own KV-event path, with ``keep``) and, with ``config`` (kvoffload
    publishes: ``kv_connector_extra_config.kv_events``), turned into vLLM's event types and chunk
    :class:`~kvoffload.events.Movement` s, published once per engine step.

    Called under the manager's lock (engine thread, or a thread serving peers), except
    :meth:`publish` and :meth:`close`, which must run outside it (the publisher's thread may wait).

    Args:
        host: the host tier (its stored/removed events, its index of held keys).
        tiers: the secondary tiers, in order.
        config: the publisher's settings, or None (nothing published).
        routed: those of ``tiers`` that follow requests' routing, as the manager found them
            (:func:`~kvoffload.tiers.base.routed`): their movements name the other instance.
        keep: keep the collected events for :meth:`take`.
        host_name: the host tier's name in events (``"host"``).
        instance: this manager's metrics instance label (the publisher's ``instance``).
        data_parallel_rank: the engine's data-parallel rank (the publisher binds port + rank).
        block_size: tokens per chunk (the ``block_size`` of a chunk published without info).
        block_hash: ``key -> block hash`` for chunks published without info (default: the key).
        row_bytes: bytes per chunk (each movement's size).

    Raises:
        kvoffload.config.ConfigError: the publisher cannot bind its endpoints (in use, bad
            address), naming them.
    """

    def __init__(
        self,
        host: Any,
        tiers: Sequence[SecondaryTierManager],
        config: Any,
        *,
        routed: Iterable[RoutedTier] = (),
        keep: bool,
        host_name: str,
        instance: str,
        data_parallel_rank: int,
        block_size: int,
        block_hash: Callable[[bytes], Any] | None,
        row_bytes: int,
    ):
        self.host = host
        self.tiers = list(tiers)
        self.host_name = host_name
        self.row_bytes = row_bytes
        self._keep = keep
        self._taken: list[tuple[str, TierEvent]] = []
        #: What the events kept for :meth:`take` name instead of the tiers' keys, applied as they
        #: are collected (the tiering manager's: a tenant key's engine key, or left out when
        #: unknown): ``(keys, tier or None for the host tier) -> keys``; None keeps them.
        self.to_engine: Callable[[list[bytes], Any], list[bytes]] | None = None
        self._engine: list[BlockStored | BlockRemoved] = []
        #: The publisher (None when nothing is published): ``endpoint``, ``replay_endpoint``,
        #: ``published`` batch counts per stream, ``flush()``.
        self.publisher: EventPublisher | None = None
        self._moves: list[Movement] | None = None
        self._translator: KVEventTranslator | None = None
        if config is None:
            return
        try:
            self.publisher = EventPublisher(config, instance, data_parallel_rank)
        except Exception as e:
            from kvoffload.config import ConfigError

            where = repr(config.endpoint) + (
                f" or replay_endpoint {config.replay_endpoint!r}" if config.replay_endpoint else ""
            )
            if data_parallel_rank:
                where += f" (+ {data_parallel_rank} for data-parallel rank {data_parallel_rank})"
            raise ConfigError(
                f"kv_connector_extra_config.kv_events.endpoint: cannot bind {where}: {e}"
            ) from None
        self._moves = []
        # a routed tier (a peer tier) names the instance each chunk came from or went to
        self._origin = {t.name: t.origin for t in routed}
        self._localities = {host_name: "local", **{t.name: t.locality.lower() for t in tiers}}
        self._translator = KVEventTranslator(
            media={host_name: "CPU", **{t.name: t.medium for t in tiers}},
            localities=self._localities,
            host=host_name,
            block_size=block_size,
            block_hash=block_hash,
            max_infos=2 * host.num_slots,
        )

    @property
    def published(self) -> dict[str, int]:
        """Batches published per stream (``engine``, ``movements``); empty when off."""
        return self.publisher.published if self.publisher is not None else {}

    def remember(self, keys: Iterable[bytes], chunk_info: Any) -> None:
        """Keep what ``chunk_info.get(key)`` says of each of ``keys`` (just reserved in the host
        tier) for their ``BlockStored`` events; nothing when events are not published."""
        if self._translator is not None:
            self._translator.remember(keys, chunk_info)

    def forget(self, keys: Iterable[bytes]) -> None:
        """The store of ``keys`` failed: drop what :meth:`remember` kept of those not held."""
        if self._translator is not None:
            self._translator.forget(keys, self.host.index)

    def moved(
        self,
        keys: Iterable[bytes],
        src: str,
        dst: str,
        *,
        tier: Any = None,
        locality: str | None = None,
    ) -> None:
        """Record movements of ``keys`` from ``src`` to ``dst`` (nothing when events are not
        published). ``tier``: the secondary tier moved to or from (its locality, and the
        instance each chunk came from or went to for a peer tier); ``locality`` overrides
        (``"local"`` without a tier)."""
        moves = self._moves
        if moves is None:
            return
        nbytes = self.row_bytes
        if tier is None:
            where = locality or "local"
            moves.extend(Movement(k, src, dst, where, nbytes) for k in keys)
        else:
            where = locality or self._localities[tier.name]
            origin = self._origin.get(tier.name)
            if origin is None:
                moves.extend(Movement(k, src, dst, where, nbytes) for k in keys)
            else:
                moves.extend(Movement(k, src, dst, where, nbytes, origin(k)) for k in keys)

    def drain(self) -> None:
        """Collect the host tier's and tiers' events: kept for :meth:`take` and, when
        published, translated (an eviction also moves a chunk to ``none``)."""
        name = self.host_name
        got = [(name, e) for e in self.host.take_events()]
        for tier in self.tiers:
            got.extend((tier.name, e) for e in tier.take_events())
        if not got:
            return
        if self._keep:
            to_engine = self.to_engine
            if to_engine is None:
                self._taken.extend(got)
            else:
                by_name = {t.name: t for t in self.tiers}
                for name, ev in got:
                    keys = to_engine(ev.keys, by_name.get(name))
                    if keys:
                        self._taken.append((name, TierEvent(keys, ev.removed)))
        if self._translator is None:
            return
        self._engine.extend(self._translator.translate(got, self.host.index))
        localities = self._localities
        for src, ev in got:
            if ev.removed:
                self.moved(ev.keys, src, "none", locality=localities[src])

    def take(self) -> list[tuple[str, TierEvent]]:
        """``(tier name, event)`` pairs collected since the last call, host first."""
        self.drain()
        out, self._taken = self._taken, []
        return out

    def take_batch(self) -> tuple[list[BlockStored | BlockRemoved], list[Movement]] | None:
        """This step's engine events and movements, to :meth:`publish` once the manager's lock
        is released; None when there is nothing to publish."""
        if self.publisher is None:
            return None
        self.drain()
        moves = self._moves or []
        if not (self._engine or moves):
            return None
        events = self._engine
        self._engine, self._moves = [], []
        return events, moves

    def publish(self, batch: tuple[list[BlockStored | BlockRemoved], list[Movement]]) -> None:
        """Hand a :meth:`take_batch` to the publisher's thread (outside the manager's lock)."""
        if self.publisher is not None:
            self.publisher.publish(*batch)

    def close(self) -> None:
        """Close the publisher (what it holds is sent first, within its time limit)."""
        if self.publisher is not None:
            self.publisher.close()
