"""Chunk namespaces and chunk keys (DESIGN.md §4 "Keys and namespaces").

A :class:`Namespace` fingerprints everything that makes stored KV bytes incompatible. Two namespaces
never share a chunk: persistent tiers keep each in its own directory (or key prefix) named by
:meth:`Namespace.id` and holding a ``config.json`` of the fields, and every stored chunk's header
carries the id. Names never contain model names or other user strings, only hex digests, so no model
name can collide with another or escape the root directory (CASES C04).

Chunk keys are deterministic across processes and machines: vLLM's block hashes (sha256 by default)
or, for standalone use, :func:`chunk_keys`, a chained xxh3-128 over the token ids that uses no
per-process seed (CASES C05).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import msgspec
import numpy as np
import xxhash

from kvoffload.workers import chunkfile as cf
from kvoffload.workers.chunkfile import FORMAT_VERSION

_KEY_ROOT = xxhash.xxh3_128_digest(b"kvoffload/chunk-key/v1")


class GroupShape(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Shape of one KV-cache group's share of a chunk.

    Attributes:
        tokens_per_block: tokens per engine block of this group.
        num_layers: layers in the group.
        page_bytes: bytes of one block of this group as a row holds it (for vLLM: the group's
            pages across its layers, times the worker pages a canonical page holds).
        kind: the layer kind (vLLM's ``KVCacheSpecKind`` value: ``full_attention``,
            ``sliding_window``, ``mamba``, ``mla_attention``...; ``unknown`` when not known).
        group_id: the group's index in the engine's KV-cache config (its chunk keys' suffix).
        window_chunks: chunks a load needs at a hit's boundary; None: the whole prefix
            (:class:`kvoffload.hybrid.GroupLayout`).
        shape: what else decides the group's bytes (heads, head sizes, dtypes, window, state
            shapes), ``name=value;...``.
    """

    tokens_per_block: int
    num_layers: int
    page_bytes: int
    kind: str = "full"
    group_id: int | None = None
    window_chunks: int | None = None
    shape: str = ""


class Namespace(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Everything that makes chunk bytes incompatible.

    Attributes:
        model: model id (e.g. ``HuggingFaceTB/SmolLM2-135M-Instruct``) or path as given.
        revision: model revision (commit, tag) when known.
        model_path: resolved absolute path for a local model directory.
        model_fingerprint: digest of a local model's config and weight file names and sizes, so
            weights replaced in place are a new namespace.
        kv_dtype: KV cache dtype (``bfloat16``, ``float8_e4m3``...).
        layout: layout id of the bytes in a row (``vllm-direct-v1``, ``vllm-canonical-v1``,
            ``raw-v1``), including the engine's KV cache layout name where it matters.
        tokens_per_chunk: tokens one chunk covers.
        row_bytes: bytes per chunk (one arena row).
        groups: KV-cache group shapes.
        tp_size, pp_size, pcp_size, dcp_size: parallel geometry; None when the layout is canonical
            (the same bytes under any geometry).
        tp_rank: set when a row holds a single rank's shard rather than all ranks' pages.
        format_version: on-disk chunk format version.
        cache_salt: user salt for deliberate isolation (tenants, experiments).
    """

    model: str
    revision: str | None = None
    model_path: str | None = None
    model_fingerprint: str | None = None
    kv_dtype: str
    layout: str
    tokens_per_chunk: int
    row_bytes: int
    groups: tuple[GroupShape, ...] = ()
    tp_size: int | None = 1
    pp_size: int | None = 1
    pcp_size: int | None = 1
    dcp_size: int | None = 1
    tp_rank: int | None = None
    format_version: int = FORMAT_VERSION
    cache_salt: str = ""

    def id_bytes(self) -> bytes:
        """16-byte xxh3-128 digest of the canonical JSON encoding of every field."""
        return xxhash.xxh3_128_digest(msgspec.json.encode(self))

    def id(self) -> str:
        """32 hex digits: the namespace's directory name on persistent tiers."""
        return self.id_bytes().hex()

    def to_json(self) -> bytes:
        """The ``config.json`` written next to the namespace's chunks."""
        return msgspec.json.format(msgspec.json.encode(self), indent=2) + b"\n"


class KeyedNamespace(Namespace, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A :class:`Namespace` whose chunks carry a keyed MAC (a tier's ``integrity_key_env``,
    CASES C43): the same fields plus the key's id, so its id differs from the unkeyed one's and
    from every other key's, and keyed and unkeyed instances (or two keys) never share a directory
    or prefix, where each would remove the other's chunks as forged.

    Attributes:
        integrity_key_id: :func:`kvoffload.workers.chunkfile.key_id` of the integrity secret (16
            hex digits; an HMAC of a constant, which says nothing of the key).
    """

    integrity_key_id: str


def for_integrity_key(namespace: Namespace, env_name: str | None) -> Namespace:
    """``namespace`` as a tier with integrity key ``env_name`` (an environment variable's name,
    None: no key) stores it: unchanged without a key, else its :class:`KeyedNamespace`.

    Raises:
        ValueError: the variable is unset, empty or holds too short a key; the message names the
            setting and the variable, never the key.
    """
    if env_name is None:
        return namespace
    try:
        secret = cf.secret_from_env(env_name)
    except cf.IntegrityKeyError as e:
        raise ValueError(str(e)) from None
    fields = msgspec.structs.asdict(namespace)
    fields.pop("integrity_key_id", None)
    return KeyedNamespace(**fields, integrity_key_id=cf.key_id(secret))


class EncryptedNamespace(Namespace, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A :class:`Namespace` whose chunks are stored encrypted (a tier's ``encryption_key_env``):
    the same fields, the integrity key's id when the tier has one, and the encryption master
    key's id, so encrypting and plain instances (or two master keys) never share a directory or
    prefix, where each would take the other's chunks for forged or corrupt.

    Attributes:
        integrity_key_id: as :class:`KeyedNamespace`'s; "" when the tier has no integrity key.
        encryption_key_id: :func:`kvoffload.workers.chunkseal.key_id` of the master key (16 hex
            digits, an HMAC of a constant).
    """

    integrity_key_id: str = ""
    encryption_key_id: str


def for_encryption_key(namespace: Namespace, env_name: str | None) -> Namespace:
    """``namespace`` as a tier with encryption master key ``env_name`` (an environment
    variable's name, None: no encryption) stores it: unchanged without one, else its
    :class:`EncryptedNamespace`.

    Raises:
        ValueError: the variable is unset, empty or holds too short a key; the message names the
            setting and the variable, never the key.
    """
    if env_name is None:
        return namespace
    from kvoffload.workers.chunkseal import key_id

    try:
        secret = cf.secret_from_env(env_name, "encryption_key_env")
    except cf.IntegrityKeyError as e:
        raise ValueError(str(e)) from None
    fields = msgspec.structs.asdict(namespace)
    fields.pop("encryption_key_id", None)
    return EncryptedNamespace(**fields, encryption_key_id=key_id(secret))


def model_fingerprint(model_path: str) -> str | None:
    """Digest of a local model directory's ``config.json`` contents and its weight files' names and
    sizes; None when ``model_path`` is not a directory."""
    if not os.path.isdir(model_path):
        return None
    h = xxhash.xxh3_128()
    for name in sorted(os.listdir(model_path)):
        full = os.path.join(model_path, name)
        if name == "config.json":
            with open(full, "rb") as f:
                h.update(f.read())
        elif name.endswith((".safetensors", ".bin", ".gguf", ".pt")):
            h.update(f"{name}:{os.path.getsize(full)};".encode())
    return h.hexdigest()


def chunk_keys(
    token_ids: Sequence[int] | np.ndarray,
    tokens_per_chunk: int,
    *,
    parent: bytes | None = None,
    group_idx: int = 0,
) -> list[bytes]:
    """Prefix-chained keys of the full chunks of ``token_ids``.

    Key ``i`` names the whole prefix ``token_ids[: (i + 1) * tokens_per_chunk]``: it is xxh3-128 of the
    previous chunk's hash and this chunk's token ids (int64, little-endian), followed by the 4-byte
    big-endian KV-group index (the same packing as vLLM's ``make_offload_key``). No per-process seed.

    Args:
        token_ids: the tokens (ints).
        tokens_per_chunk: tokens per chunk (> 0); a trailing partial chunk gets no key.
        parent: hash (16 bytes) of the prefix before ``token_ids``; None for the start of a sequence.
        group_idx: KV-cache group index.

    Returns:
        ``len(token_ids) // tokens_per_chunk`` keys of 20 bytes each.
    """
    if tokens_per_chunk <= 0:
        raise ValueError("tokens_per_chunk must be > 0")
    toks = np.asarray(token_ids, dtype="<i8")
    h = parent if parent is not None else _KEY_ROOT
    suffix = group_idx.to_bytes(4, "big")
    keys = []
    for i in range(len(toks) // tokens_per_chunk):
        h = xxhash.xxh3_128_digest(
            h + toks[i * tokens_per_chunk : (i + 1) * tokens_per_chunk].tobytes()
        )
        keys.append(h + suffix)
    return keys
