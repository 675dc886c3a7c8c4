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

from kvoffload.events import BlockRemoved, BlockStored, ChunkEventInfo
from kvoffload.tiers.base import TierEvent


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
        its own event with the engine's values; the keys of one tier event without one share a
        plain event (the key's block hash, no parent, no tokens). ``held``: the host tier's keys
        after these events (the infos of chunks that left it are dropped)."""
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
                                block_hashes=list(info.block_hashes),
                                medium=medium,
                                group_idx=info.group_idx,
                                locality=locality,
                                ownership=owner,
                            )
                        )
                    else:
                        out.append(
                            BlockStored(
                                block_hashes=list(info.block_hashes),
                                parent_block_hash=info.parent_block_hash,
                                token_ids=info.token_ids,
                                block_size=info.block_size,
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
