"""KV-cache groups of hybrid models: what a chunk of each group holds, how it fits an arena row,
and how long a hit every group can serve (DESIGN.md §4, "Hybrid models").

A hybrid model's KV cache is split by layer kind into groups (vLLM's hybrid allocator: one group
of full-attention layers, one per sliding-window size, one of state-space (Mamba) layers, ...).
Every group is chunked on the same token boundaries and every chunk of every group takes one
arena row of one fixed size::

    row (row_bytes) = [ group g's payload: layers x blocks_per_chunk blocks (x copies) | padding ]

A chunk key names its group (the 4-byte group suffix of vLLM's ``OffloadKey``), so the chunks of
one prefix are one row per group. What a load needs differs by kind:

    full attention      every chunk of the prefix                         window_chunks = None
    sliding window      the chunks the window still reaches at the hit    window_chunks = w
    chunked local       the chunk holding the hit's local block           window_chunks = w
    state space (Mamba) the state at the hit's boundary, stored with the  window_chunks = 1
                        chunk that ends there
    MLA                 like full attention; its latent is the same on every TP rank, so one copy

This module is plain data and arithmetic (no vLLM, no torch): :mod:`kvoffload.vllm.hybrid` builds
:class:`GroupLayout` s from vLLM's ``KVCacheConfig``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import msgspec

# vLLM's KVCacheSpecKind values (vllm.v1.kv_cache_interface), the names the namespace records.
FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
MAMBA = "mamba"
MLA_ATTENTION = "mla_attention"
SLIDING_WINDOW_MLA = "sliding_window_mla"
UNKNOWN = "unknown"


class GroupLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One KV-cache group as the host tier stores it.

    Attributes:
        group_id: the group's index in the engine's KV-cache config (vLLM's ``group_id``; the
            4-byte suffix of the group's chunk keys).
        kind: the layer kind (vLLM's ``KVCacheSpecKind`` value: ``full_attention``,
            ``sliding_window``, ``mamba``, ``mla_attention``, ...; ``unknown`` when the engine
            did not say).
        tokens_per_chunk: tokens one chunk of this group covers (tokens per block x blocks per
            chunk).
        num_layers: layers in the group.
        block_bytes: bytes one engine block of this group occupies on one worker, summed over the
            group's layers (vLLM's page size, padding included).
        window_chunks: chunks ending at a hit's boundary that a load needs; None: every chunk of
            the prefix (full attention, MLA). A Mamba group needs 1: the state at the boundary.
        reach_tokens: for a sliding-window group, the tokens before a hit's end that its load
            must hold (vLLM: ``sliding_window - 1 + extra_retained_tokens``, the second being
            the tokens multi-module speculative decoding re-prefills); a hit ending inside a chunk
            may then need one chunk more than ``window_chunks`` (:meth:`end_window_chunks`).
            None: the window is whole chunks (chunked local attention) or there is none.
        replicated: every tensor-parallel rank holds the same bytes (an MLA latent, a replicated
            Mamba state), so a row needs one copy, not one per rank (whether it holds one is the
            engine's layout: vLLM's ``replicated_layout``).
        shape: what else makes this group's bytes incompatible (heads, head sizes, dtypes, window,
            state shapes), as ``name=value`` pairs joined by ``;`` in a fixed order.
    """

    group_id: int
    kind: str
    tokens_per_chunk: int
    num_layers: int
    block_bytes: int
    window_chunks: int | None = None
    reach_tokens: int | None = None
    replicated: bool = False
    shape: str = ""

    @property
    def is_state(self) -> bool:
        """The group holds a recurrent state (one per chunk boundary), not per-token KV."""
        return self.kind == MAMBA

    def payload_bytes(self, blocks_per_chunk: int, copies: int) -> int:
        """Bytes of one chunk of this group in a row: ``block_bytes`` x ``blocks_per_chunk`` x
        the rank copies a row holds."""
        return self.block_bytes * blocks_per_chunk * max(copies, 1)

    def load_chunks(self, computed_tokens: int, hit_end: int) -> range:
        """Indices of this group's chunks a load of tokens ``[computed_tokens, hit_end)`` reads.

        Full attention reads every chunk from the first not yet computed; a windowed group only
        the ``window_chunks`` chunks ending at ``hit_end`` (the others fall out of every window and
        are not reloaded); a Mamba group the one chunk whose boundary is ``hit_end``.

        Raises:
            ValueError: ``hit_end`` is not on one of this group's chunk boundaries.
        """
        if hit_end % self.tokens_per_chunk:
            raise ValueError(
                f"KV group {self.group_id}: a hit ending at token {hit_end} is not on a chunk "
                f"boundary of {self.tokens_per_chunk} tokens"
            )
        end = hit_end // self.tokens_per_chunk
        start = computed_tokens // self.tokens_per_chunk
        if self.window_chunks is not None:
            start = max(start, end - self.window_chunks)
        return range(start, max(start, end))

    def end_window_chunks(self, hit_end: int) -> int | None:
        """Chunks ending with the one holding token ``hit_end - 1`` that a load of a hit ending at
        token ``hit_end`` needs (``hit_end`` may be inside a chunk): ``window_chunks``, widened
        where the window's reach plus the chunk's tokens from ``hit_end`` on spans more chunks
        (vLLM's ``load_window_size_in_chunks``, 0.32 and 0.33: only with
        ``extra_retained_tokens``, since ``window_chunks`` already covers the window itself)."""
        w = self.window_chunks
        if w is None or self.reach_tokens is None:
            return w
        tpc = self.tokens_per_chunk
        return max(w, -(-(self.reach_tokens + (-hit_end % tpc)) // tpc))

    def end_load_chunks(self, computed_tokens: int, hit_end: int) -> range:
        """Indices of this group's chunks a load of tokens ``[computed_tokens, hit_end)`` reads
        where ``hit_end`` may be inside a chunk (the chunk holding it is read whole): like
        :meth:`load_chunks` at the next boundary, over :meth:`end_window_chunks` chunks."""
        end = -(-hit_end // self.tokens_per_chunk)
        start = computed_tokens // self.tokens_per_chunk
        w = self.end_window_chunks(hit_end)
        if w is not None:
            start = max(start, end - w)
        return range(start, max(start, end))


class GroupRow(msgspec.Struct, frozen=True, kw_only=True):
    """How one group's chunk fills a row (bytes)."""

    group_id: int
    kind: str
    payload_bytes: int
    padding_bytes: int
    copies: int


def row_geometry(
    groups: Sequence[GroupLayout], row_bytes: int, blocks_per_chunk: int, copies: int
) -> tuple[GroupRow, ...]:
    """Each group's payload and padding in a row of ``row_bytes`` bytes.

    Args:
        groups: the engine's groups.
        row_bytes: bytes per arena row (the same for every group).
        blocks_per_chunk: engine blocks per chunk.
        copies: rank areas a row holds (1 for a replicated or canonical layout).

    Raises:
        ValueError: a group's chunk does not fit a row (names the group and both sizes).
    """
    out = []
    for g in groups:
        payload = g.payload_bytes(blocks_per_chunk, copies)
        if payload > row_bytes:
            raise ValueError(
                f"KV group {g.group_id} ({g.kind}): a chunk of {payload} bytes does not fit a "
                f"row of {row_bytes} bytes"
            )
        out.append(
            GroupRow(
                group_id=g.group_id,
                kind=g.kind,
                payload_bytes=payload,
                padding_bytes=row_bytes - payload,
                copies=max(copies, 1),
            )
        )
    return tuple(out)


def hit_step(groups: Sequence[GroupLayout]) -> int:
    """Tokens between hit boundaries every group can end on: the least common multiple of the
    groups' ``tokens_per_chunk``."""
    return math.lcm(*(g.tokens_per_chunk for g in groups)) if groups else 0


def ends_inside_chunk(groups: Sequence[GroupLayout]) -> bool:
    """Whether the engine may end a hit inside a chunk, at its limit (the last prompt token but
    one): vLLM's offloading scheduler does where a group is windowed and none is a Mamba group
    (a Mamba group aligns every hit to its chunks). 0.32 and 0.33 alike."""
    return any(g.window_chunks is not None for g in groups) and not any(g.is_state for g in groups)


def hit_tokens(
    groups: Sequence[GroupLayout],
    present: Callable[[GroupLayout, int], bool],
    computed_tokens: int,
    max_tokens: int,
    last_chunk_whole: bool = False,
) -> int:
    """Tokens after ``computed_tokens`` that the offloaded chunks can serve: the longest prefix
    every group can serve.

    A hit ends at a boundary ``T`` on every group's chunk grid (a multiple of :func:`hit_step`)
    with ``computed_tokens < T <= max_tokens`` and at least one chunk of every group to load; it
    is served when every chunk of :meth:`GroupLayout.load_chunks` ``(computed_tokens, T)`` is
    present in every group. So a full-attention group needs the whole prefix, a windowed group
    its window, and a Mamba group the state at ``T`` itself: attention KV is never loaded without
    the state at the same boundary, nor the state without the KV before it.

    Where the chunk holding token ``max_tokens`` is whole (``last_chunk_whole``) and
    :func:`ends_inside_chunk` (vLLM with windowed groups and no Mamba group), a hit may also end
    at ``max_tokens`` itself, inside that chunk: it is served when every group holds the chunks
    of :meth:`GroupLayout.end_load_chunks` (the boundary after it, over a window that
    ``extra_retained_tokens`` may widen by a chunk; the last chunk is loaded whole, its tokens from
    ``max_tokens`` on recomputed), and vLLM takes that end before any boundary.

    Args:
        groups: the engine's groups (none: nothing is served).
        present: whether chunk ``index`` of a group is stored (a host or tier hit).
        computed_tokens: tokens the engine already holds (its own prefix-cache hit).
        max_tokens: the longest hit the engine may take (vLLM keeps the last prompt token to
            recompute: pass ``prompt_tokens - 1``).
        last_chunk_whole: the chunk holding token ``max_tokens`` is a whole chunk, stored like
            the others (vLLM: the prompt ends on a chunk boundary, so its last chunk has a key).

    Returns:
        ``T - computed_tokens`` for the largest served ``T``, else 0.
    """
    step = hit_step(groups)
    if not step or max_tokens <= computed_tokens:
        return 0
    min_hit = max(g.tokens_per_chunk for g in groups)
    # Full-attention groups: the first missing chunk bounds every boundary from above.
    limit = max_tokens // step * step
    for g in groups:
        if g.window_chunks is None:
            i = computed_tokens // g.tokens_per_chunk
            while (i + 1) * g.tokens_per_chunk <= limit and present(g, i):
                i += 1
            limit = min(limit, i * g.tokens_per_chunk // step * step)
    windowed = [g for g in groups if g.window_chunks is not None]
    if (
        last_chunk_whole
        and max_tokens % step
        and max_tokens - computed_tokens >= min_hit
        and ends_inside_chunk(groups)
    ):
        if all(
            all(present(g, i) for i in g.end_load_chunks(computed_tokens, max_tokens))
            for g in groups
        ):
            return max_tokens - computed_tokens
    for end in range(limit, computed_tokens, -step):
        if end - computed_tokens < min_hit:
            break
        if all(all(present(g, i) for i in g.load_chunks(computed_tokens, end)) for g in windowed):
            return end - computed_tokens
    return 0


class WindowScans:
    """Which chunks of windowed groups are promoted from a secondary tier: only those of the
    window the hit can end with.

    vLLM's scheduler finds a windowed group's hit by looking its chunks up from the right (the
    prompt's end) until it has a window of consecutive hits; a RETRY resets its count, and it
    scans on to the first chunk only so that the manager starts its tier lookups. Promoting every
    chunk such a scan finds in a tier would move (and hold host slots for) chunks that fall out of
    every window the hit can end with. So during a scan a tier's chunk is answered RETRY, not
    promoted (:meth:`TieringManager.lookup <kvoffload.tiering.TieringManager.lookup>` with
    ``promote`` False), and each lookup's answer is recorded (:meth:`record`); at the step's end
    (:meth:`chosen`) the scan picks its window: the rightmost run of chunks not answered MISS
    (a RETRY may still be a hit) of at least ``window_chunks`` chunks, and promotes its rightmost
    ``window_chunks``. Where vLLM looked past chunks it was told HIT or HIT_PENDING it needs more
    than they are (a window one chunk wider where the rightmost chunk is partial, vLLM's
    ``load_window_size_in_chunks``): a run of only those is skipped, and a run's next chunk past
    them is promoted too, one step later. Chunks in the host tier are answered as ever.

    A scan is the keys of one request and group looked up one chunk apart, right to left (a key
    that is not the previous one's left neighbour starts a new scan; a step's last scan counts).

    A bound on waiting: a chunk answered RETRY in ``max_retry_steps`` steps' scans of a request
    without ever being chosen is given up (:meth:`exhausted`): the caller answers MISS for it from
    then on, so a scan this class cannot resolve costs the request a recompute of that part,
    never a request that waits forever (vLLM asks again every step while it is told RETRY).

    Args:
        groups: the engine's groups; those with ``window_chunks`` are tracked.
        max_retry_steps: steps a chunk may be answered RETRY unchosen before it is given up
            (>= 1).

    Raises:
        ValueError: ``max_retry_steps`` below 1.
    """

    def __init__(self, groups: Sequence[GroupLayout], max_retry_steps: int = 64):
        if max_retry_steps < 1:
            raise ValueError(f"max_retry_steps: must be >= 1, got {max_retry_steps}")
        self._groups = {g.group_id: g for g in groups if g.window_chunks is not None}
        # (request id, group id) -> the step's last scan: [(key, end token, answer)], right to left
        self._scans: dict[tuple[str, int], list[tuple[bytes, int, str]]] = {}
        self.max_retry_steps = max_retry_steps
        # (request id, key) -> steps in which the key was answered RETRY and not chosen
        self._unchosen: dict[tuple[str, bytes], int] = {}

    def __bool__(self) -> bool:
        return bool(self._groups)

    def tracks(self, group_id: int, end: int | None = None) -> bool:
        """Whether chunks of ``group_id`` are promoted only in their window (with ``end``: the
        chunk ending at token ``end``; a key off the chunk grid, such as vLLM's partial-tail
        boundary key, is not)."""
        g = self._groups.get(group_id)
        return g is not None and (end is None or end % g.tokens_per_chunk == 0)

    def record(self, req_id: str, group_id: int, key: bytes, end: int, answer: str) -> None:
        """``req_id``'s lookup of ``key``, the chunk of ``group_id`` ending at token ``end``, was
        answered ``answer`` (``HIT``, ``HIT_PENDING``, ``RETRY`` or ``MISS``)."""
        g = self._groups[group_id]
        scan = self._scans.get((req_id, group_id))
        if scan is None or end != scan[-1][1] - g.tokens_per_chunk:
            scan = self._scans[(req_id, group_id)] = []
        scan.append((key, end, answer))

    def chosen(self) -> list[tuple[str, bytes]]:
        """``(request id, key)`` of the chunks answered RETRY that the step's scans chose to
        promote (see the class docstring); forgets the scans."""
        out: list[tuple[str, bytes]] = []
        retried: list[tuple[str, bytes]] = []
        for (req_id, group_id), scan in self._scans.items():
            retried += [(req_id, k) for k, _, a in scan if a == "RETRY"]
            g = self._groups[group_id]
            assert g.window_chunks is not None
            start = 0
            while start < len(scan):
                if scan[start][2] == "MISS":
                    start += 1
                    continue
                stop = start
                while stop < len(scan) and scan[stop][2] != "MISS":
                    stop += 1
                run = scan[start:stop]
                hits = next((i for i, c in enumerate(run) if c[2] not in _HIT_LIKE), len(run))
                # a run reaching the prefix's first chunk is a whole window however short: a hit
                # ending within the first window needs only the chunks before it
                whole = len(run) >= g.window_chunks or run[-1][1] == g.tokens_per_chunk
                if whole and not (hits == len(run) and stop < len(scan)):
                    need = max(g.window_chunks, hits + 1)
                    out += [(req_id, k) for k, _, a in run[:need] if a == "RETRY"]
                    break
                start = stop
        self._scans.clear()
        picked = set(out)
        unchosen = self._unchosen
        for rk in dict.fromkeys(retried):  # once a step, however often the step scanned it
            if rk in picked:
                unchosen.pop(rk, None)
            else:
                unchosen[rk] = unchosen.get(rk, 0) + 1
        return out

    def exhausted(self, req_id: str, key: bytes) -> bool:
        """Whether ``req_id``'s chunk ``key`` has been answered RETRY unchosen in
        ``max_retry_steps`` steps (the caller then answers MISS: see the class docstring)."""
        return self._unchosen.get((req_id, key), 0) >= self.max_retry_steps

    def forget(self, req_id: str) -> None:
        """The request finished: drop its scans."""
        for k in [k for k in self._scans if k[0] == req_id]:
            del self._scans[k]
        for rk in [rk for rk in self._unchosen if rk[0] == req_id]:
            del self._unchosen[rk]


_HIT_LIKE = ("HIT", "HIT_PENDING")


def chunks_per_request(groups: Sequence[GroupLayout], num_tokens: int) -> int:
    """Rows one request of ``num_tokens`` tokens needs to be served whole: per group its chunks,
    at most its window (how the host tier's capacity in tokens is counted)."""
    total = 0
    for g in groups:
        n = -(-num_tokens // g.tokens_per_chunk)
        if g.window_chunks is not None:
            n = min(n, g.window_chunks)
        total += n
    return total


def describe_groups(groups: Sequence[GroupLayout], rows: Sequence[GroupRow]) -> list[str]:
    """Lines for the start-up log, one per run of consecutive groups offloaded alike (vLLM splits
    e.g. a model's sliding-window layers into several equal groups): ``KV groups 0-4 (...)``."""
    lines: list[str] = []
    runs: list[tuple[int, int, str]] = []  # first id, last id, the line after the ids
    for g, row in zip(groups, rows, strict=True):
        text = describe_group(g, row).split(" ", 3)[3]
        if runs and runs[-1][2] == text and runs[-1][1] + 1 == g.group_id:
            runs[-1] = (runs[-1][0], g.group_id, text)
        else:
            runs.append((g.group_id, g.group_id, text))
    for first, last, text in runs:
        ids = f"groups {first}-{last}" if last > first else f"group {first}"
        lines.append(f"KV {ids} {text}")
    return lines


def describe_group(g: GroupLayout, row: GroupRow) -> str:
    """One line for the start-up log: what is offloaded of group ``g`` and how it fills a row
    (``KV group <id> (<kind>, ...): ...``)."""
    if g.window_chunks is None:
        what = "every chunk of the prefix"
    elif g.is_state:
        what = "the state at each chunk boundary, loaded with that chunk"
    else:
        what = f"only the {g.window_chunks} chunk(s) its window reaches are reloaded"
    if row.copies == 1:
        copies = "; one copy for all TP ranks" if g.replicated else ""
    else:
        copies = f"; {row.copies} rank copies"
    return (
        f"KV group {g.group_id} ({g.kind}, {g.num_layers} layers, {g.tokens_per_chunk} tokens "
        f"per chunk): {what}; {row.payload_bytes} bytes per chunk + {row.padding_bytes} padding"
        f"{copies}"
    )
