"""Tenants: the chunks of requests with a ``cache_salt`` kept apart in every tier (DESIGN.md §4
"Tenants").

A request's ``cache_salt`` (vLLM's OpenAI API field; one secret per tenant) names its tenant. The
salt itself is never kept, stored, logged or counted: what travels is

- the **tenant id** (:func:`tenant_id`): 32 hex digits, a keyed hash of the salt (HMAC-SHA256 under a
  constant key, or under ``tenant_key_env``'s secret when configured, so that nobody without it can
  test a guessed salt against an id: :func:`tenant_secret`). Persistent tiers keep a tenant's chunks in its directory
  ``<namespace id>/t-<tenant id>/`` (``kvoffload.workers.chunkfile.tenant_dir``), so
  ``kvoffload purge --salt`` can erase it; and
- the **tenant key** of each chunk (:func:`tenant_key`): the chunk key the tiers see for a salted
  request, a keyed BLAKE2b of the engine's key under the tenant id, plus the key's 4-byte KV-group
  suffix. Every tier (the host tier, memory, fs, obj, p2p, out-of-tree ones) indexes chunks by key,
  so two tenants' chunks of one engine key are two different keys there: a lookup under one salt
  can reach another's chunk only through a collision of a 128-bit keyed hash. The tiering manager
  turns engine keys into tenant keys at its entry points and back at its exits
  (:class:`~kvoffload.tiering.TieringManager`); nothing else needs to know.

Unsalted requests use the engine's keys unchanged (no tenant, no cost).
"""

from __future__ import annotations

import hashlib
import hmac

from kvoffload.workers.chunkfile import TENANT_ID_HEX, is_tenant_id

__all__ = [
    "TENANT_ID_HEX",
    "TENANT_KEY_BYTES",
    "is_tenant_id",
    "tenant_id",
    "tenant_key",
    "tenant_secret",
]

TENANT_KEY_BYTES = 20
"""The length of every tenant key (:func:`tenant_key`): 16 bytes of BLAKE2b and the group suffix."""

_ID_KEY = b"kvoffload tenant id v1"
_KEY_PERSON = b"kvo-tenant-key"


def tenant_id(salt: str, secret: bytes | None = None) -> str:
    """The tenant id of ``cache_salt`` ``salt``: 32 lowercase hex digits (128 bits of an
    HMAC-SHA256 of the salt's UTF-8 bytes), the same on every instance and every run.

    Args:
        salt: the request's ``cache_salt`` (non-empty).
        secret: the tenant-id secret (``tenant_key_env``'s bytes) or None: a constant key. With a
            secret, ids depend on it: every instance sharing tiers needs the same one.

    Raises:
        ValueError: ``salt`` is empty or not a string (an empty salt is no tenant).
    """
    if not isinstance(salt, str) or not salt:
        raise ValueError("cache_salt: a non-empty string names a tenant")
    key = _ID_KEY if secret is None else hmac.digest(secret, _ID_KEY, "sha256")
    return hmac.digest(key, salt.encode("utf-8", "surrogatepass"), "sha256")[:16].hex()


def tenant_secret(env_name: str | None) -> bytes | None:
    """The tenant-id secret held by environment variable ``env_name`` (the ``tenant_key_env``
    setting; None: none, ids keyed by a constant).

    Raises:
        ValueError: the variable is unset, empty or too short; the message names the setting and
            the variable, never the value.
    """
    if env_name is None:
        return None
    from kvoffload.workers.chunkfile import IntegrityKeyError, secret_from_env

    try:
        return secret_from_env(env_name, "tenant_key_env")
    except IntegrityKeyError as e:
        raise ValueError(str(e)) from None


def tenant_key(key: bytes, tenant: str) -> bytes:
    """The key tiers hold ``key`` (an engine chunk key, ending with its 4-byte KV-group index)
    under for tenant ``tenant`` (a :func:`tenant_id`): BLAKE2b-128 of ``key`` keyed by the
    tenant id's 16 bytes, followed by ``key``'s last 4 bytes (the group index, which
    :mod:`kvoffload.hybrid` reads). 20 bytes whatever the engine key's length.

    Raises:
        ValueError: ``tenant`` is not a tenant id.
    """
    if not is_tenant_id(tenant):
        raise ValueError(f"tenant id {tenant[:40]!r} is not {TENANT_ID_HEX} lowercase hex digits")
    digest = hashlib.blake2b(
        key, digest_size=16, key=bytes.fromhex(tenant), person=_KEY_PERSON
    ).digest()
    return digest + key[-4:]
