"""``kvoffload purge``: erase a tenant's (or a namespace's) chunks from every persistent tier of a
configuration, safely while engines run.

::

    config file ──parse──▶ secondary_tiers: each tier class's purge_storage (fs: root_dir, obj:
                           bucket and prefix: kvoffload.tiers.purging; an out-of-tree tier's
                           own); None: skipped (nothing of the tier outlives its engine)

A tier that cannot be reached (a root that cannot be opened, a bucket that cannot be listed) is
an error in its own report; the other tiers are purged all the same (exit status 1).

Why it is safe while engines run (DESIGN.md §4 "Tenants"): chunk files and objects are written
once, published whole (a rename, one PUT) and never rewritten, and this command only removes
names: a reader that already opened a file reads it whole (an unlink does not truncate), a reader
that comes after finds nothing, a clean miss (``missing``), as for any chunk evicted by another
instance. A writer that was between its directory's open and its rename when the directory went
fails its store (``io_error``), never another tenant's chunk. A chunk an engine writes for the
tenant after the purge is a new one: purge once the tenant's requests have stopped (or again).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from kvoffload.tenants import tenant_id, tenant_secret
from kvoffload.tiers.purging import (
    _NS_HEX,
    PurgeError,
    TierPurge,
    _is_hex,
    purge_fs,
    purge_obj,
)

__all__ = [
    "ArenaPurge",
    "PurgeError",
    "PurgeReport",
    "TierPurge",
    "purge",
    "purge_fs",
    "purge_obj",
]


class ArenaPurge(msgspec.Struct, kw_only=True):
    """The host arena a warm restart keeps on this machine (``arena_name`` with
    ``warm_restart_s``), as the purge left it.

    Attributes:
        name: the arena's name (``/dev/shm/<name>``).
        outcome: ``removed`` (it was kept for a successor: removed whole, its slot table names
            no tenant, so every chunk in it went; the next start of that engine is cold),
            ``absent`` (none on this machine), ``live`` (an engine has it: a running engine's
            host tier is not purged; stop it with warm restart off to erase it), ``stale``
            (nobody's and never kept: no successor adopts it; ``kvoffload sweep`` removes it),
            ``claimed`` (a successor started at that moment took it first and adopted what it
            held: stop that engine with warm restart off; a failure), ``other_namespace`` (a
            ``--namespace`` purge: the kept arena is another namespace's, left), ``error``.
        error: why it could not be looked at (``error`` only).
    """

    name: str
    outcome: str
    error: str = ""


class PurgeReport(msgspec.Struct, kw_only=True):
    """``kvoffload purge``'s answer.

    Attributes:
        what: ``tenant`` or ``namespace``.
        id: the tenant id (never the salt) or the namespace id.
        tiers: one entry per persistent tier of the config, in order.
        skipped: the config's other tiers (``name (type)``): nothing of theirs outlives an engine
            (their class's ``purge_storage`` answers None).
        host_arena: the host arena kept for a warm restart on this machine, with
            ``warm_restart_s`` (None without).
    """

    what: str
    id: str
    tiers: list[TierPurge]
    skipped: list[str] = []
    host_arena: ArenaPurge | None = None

    def failed(self) -> bool:
        """Something could not be removed or looked at (exit status 1)."""
        return any(t.errors for t in self.tiers) or (
            self.host_arena is not None and self.host_arena.outcome in ("error", "claimed")
        )


def extra_config_of(text: str, name: str) -> dict[str, Any]:
    """The ``kv_connector_extra_config`` of a config file's text (that object itself, or a whole
    ``--kv-transfer-config`` holding it).

    Raises:
        PurgeError: not JSON, or not an object.
    """
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise PurgeError(f"{name}: not JSON: {e}") from None
    if isinstance(raw, dict) and any(
        k in raw for k in ("kv_connector", "kv_role", "kv_connector_extra_config")
    ):
        raw = raw.get("kv_connector_extra_config", {})
    if not isinstance(raw, dict):
        raise PurgeError(f"{name}: expected a JSON object (kv_connector_extra_config)")
    return raw


def purge(
    extra_config: dict[str, Any],
    *,
    salt: str | None = None,
    namespace: str | None = None,
    name: str = "config",
) -> PurgeReport:
    """Remove tenant ``salt``'s chunks, or namespace ``namespace``'s, from every persistent tier
    of ``extra_config`` (exactly one of the two): each tier's
    :meth:`~kvoffload.tiers.base.SecondaryTierManager.purge_storage` (fs, obj, out-of-tree ones
    that define it); the others are listed as skipped. With ``warm_restart_s``, the host arena
    kept on this machine for a successor is removed whole (:func:`kvoffload.ipc.arena.discard_kept`;
    a ``--namespace`` purge: only if it is that namespace's); a running engine's is left.

    Raises:
        PurgeError: both or neither given, a namespace id that is not 32 lowercase hex digits, a
            config with errors, or nothing in it that outlives an engine (no persistent tier, no
            warm restart).
    """
    from kvoffload.config import parse_config_all

    if (salt is None) == (namespace is None):
        raise PurgeError("name exactly one of --salt (a tenant) and --namespace (a namespace id)")
    if namespace is not None and not _is_hex(namespace, _NS_HEX):
        raise PurgeError(
            f"--namespace {namespace[:40]!r}: a namespace id is {_NS_HEX} lowercase hex digits "
            "(the directory name `kvoffload inspect` shows)"
        )
    if salt is not None and not salt:
        raise PurgeError("--salt: empty (an unsalted request has no tenant to purge)")
    parsed = parse_config_all(extra_config, this_machine=False)
    if parsed.errors or parsed.config is None:
        first = "; ".join(f"{i.path}: {i.message}" for i in parsed.errors[:3])
        raise PurgeError(f"{name}: not a valid configuration ({first}); see `kvoffload check`")
    try:
        secret = tenant_secret(parsed.config.tenant_key_env) if salt is not None else None
    except ValueError as e:  # the engines' tenant_key_env, not in this environment
        raise PurgeError(f"{name}: {e} (the tenant ids depend on it)") from None
    tenant = tenant_id(salt, secret) if salt is not None else None
    report = PurgeReport(
        what="tenant" if tenant else "namespace", id=tenant or namespace or "", tiers=[]
    )
    for spec in parsed.config.secondary_tiers:
        try:
            done = spec.tier_class.purge_storage(
                spec.name, spec.config, tenant=tenant, namespace=namespace
            )
        except PurgeError as e:  # this tier's: the others are purged all the same
            done = TierPurge(tier=spec.name, type=spec.type, target=_target(spec), errors=[str(e)])
        except Exception as e:  # an out-of-tree tier's hook: its error, not a traceback
            why = f"{spec.name}: purge_storage failed: {type(e).__name__}: {e}"
            done = TierPurge(tier=spec.name, type=spec.type, target=_target(spec), errors=[why])
        if done is None:
            report.skipped.append(f"{spec.name} ({spec.type})")
        elif not isinstance(done, TierPurge):
            why = f"{spec.name}: purge_storage returned {type(done).__name__}, not a TierPurge"
            report.tiers.append(
                TierPurge(tier=spec.name, type=spec.type, target=_target(spec), errors=[why])
            )
        else:
            report.tiers.append(done)
    c = parsed.config
    if c.warm_restart_s > 0 and c.arena_name:
        report.host_arena = _purge_kept_arena(c.arena_name, namespace)
    if not report.tiers and report.host_arena is None:
        raise PurgeError(
            f"{name}: no persistent tier in secondary_tiers (fs, obj, or an out-of-tree tier "
            "with purge_storage) and no warm restart (warm_restart_s): nothing outlives an engine"
        )
    return report


def _purge_kept_arena(name: str, namespace: str | None) -> ArenaPurge:
    """The host arena ``name`` removed if it is kept for a warm restart (:class:`ArenaPurge`)."""
    from kvoffload.ipc import arena

    try:
        return ArenaPurge(name=name, outcome=arena.discard_kept(name, namespace))
    except arena.ArenaError as e:  # another user's, a bad mode, a keeper that did not let go
        return ArenaPurge(name=name, outcome="error", error=str(e))
    except OSError as e:  # a look at the segment failed: this tier's error, not a traceback
        return ArenaPurge(name=name, outcome="error", error=f"arena {name!r}: {e}")


def _target(spec: Any) -> str:
    """What a tier's report names as its storage when its purge failed before saying."""
    from kvoffload.tiers.fs import FsTierConfig
    from kvoffload.tiers.obj import ObjTierConfig

    c = spec.config
    if isinstance(c, FsTierConfig):
        return c.root_dir
    if isinstance(c, ObjTierConfig):
        return f"s3://{c.bucket}/{c.prefix.strip('/')}".rstrip("/")
    return spec.type


def to_json(report: PurgeReport) -> str:
    """The report as one JSON document."""
    return msgspec.json.format(msgspec.json.encode(report), indent=2).decode()


def render(report: PurgeReport, console: Any) -> None:
    """The report as a table (rich console)."""
    from rich.table import Table

    table = Table(title=f"purged {report.what} {report.id}")
    cols = ("tier", "type", "target", "namespaces", "chunks", "bytes", "other files", "versions")
    for col in cols:
        table.add_column(col, justify="right" if col in ("chunks", "bytes") else "left")
    for t in report.tiers:
        table.add_row(
            t.tier,
            t.type,
            t.target,
            str(t.namespaces),
            str(t.chunks),
            str(t.bytes),
            str(t.other_files),
            str(t.old_versions),
        )
    console.print(table)
    for t in report.tiers:
        for e in t.errors:
            console.print(f"{t.tier}: {e}", highlight=False)
    if report.skipped:
        console.print(
            "not persistent, nothing to purge: " + ", ".join(report.skipped), highlight=False
        )
    a = report.host_arena
    if a is not None:
        said = {
            "removed": "kept for a warm restart: removed whole (the next start is cold)",
            "absent": "no kept arena on this machine",
            "live": "held by a running engine: not purged (stop it with warm_restart_s 0)",
            "stale": "left by an engine and keeper that both died: nobody adopts it "
            "(`kvoffload sweep` removes it)",
            "claimed": "a successor started at that moment and adopted it first: stop that "
            "engine with warm_restart_s 0 to erase it",
            "other_namespace": "kept for another namespace: left",
            "error": a.error,
        }[a.outcome]
        console.print(f"host arena {a.name}: {said}", highlight=False)
