"""``kvoffload sweep --fs-root DIR``: remove orphaned temporary files from an fs tier root.

A store writes its chunk to a temporary file in the chunk's directory and renames it into place
(:mod:`kvoffload.workers.fs_io`); a writer killed in between leaves the temporary file behind. This
removes those orphans, safely while engines on this or other hosts write to the same root (CASES
C29): a temporary file is an orphan only when it was last written more than ``older_than_s`` seconds
ago (default :data:`~kvoffload.workers.fs_io.STALE_TEMP_AGE_S`, one hour). A live writer renames or
removes its file within its job deadline (``job_timeout_s``, 30 s by default), so an older file has
no writer left. The writer's PID in the name is never used: it means nothing in another PID
namespace (container) or on another host, where that PID may be free or belong to something else.

Fs tiers apply the same rule to their own namespace when they start; this command also reaches
namespaces no engine is running for. Chunks and ``config.json`` are never touched. Directories are
walked by descriptor with ``O_NOFOLLOW`` and files removed relative to theirs, so a symbolic link
planted inside the root is never followed (CASES C43).
"""

from __future__ import annotations

import time

import msgspec

from kvoffload.tools.tier_inspect import InspectError, namespace_dirs
from kvoffload.workers import fs_io


class StaleTemp(msgspec.Struct, kw_only=True):
    """One orphaned temporary file: ``path``, ``bytes``, ``age_s`` (seconds since last written)."""

    path: str
    bytes: int
    age_s: float


class TempSweep(msgspec.Struct, kw_only=True):
    """What a sweep of one fs tier root found and did.

    Attributes:
        root: the tier root.
        older_than_s: the orphan age used (seconds).
        stale: the orphaned temporary files found (removed unless it was a listing).
        removed: how many of them this sweep removed (0 for a listing; a file renamed or removed by
            someone else meanwhile is not counted).
        removed_bytes: their bytes.
        kept: temporary files younger than ``older_than_s`` (possibly being written), left alone.
    """

    root: str
    older_than_s: float
    stale: list[StaleTemp] = []
    removed: int = 0
    removed_bytes: int = 0
    kept: int = 0


def sweep_fs_root(
    root: str, older_than_s: float = fs_io.STALE_TEMP_AGE_S, *, remove: bool = True
) -> TempSweep:
    """Find (and unless ``remove`` is False, remove) the orphaned temporary files under ``root``.

    Args:
        root: an fs tier's ``root_dir``.
        older_than_s: a temporary file last written more than this many seconds ago is an orphan;
            must be > 0.
        remove: False lists the orphans without removing any.

    Raises:
        InspectError: ``root`` is missing, not a directory or not a tier root.
        ValueError: ``older_than_s`` <= 0.
    """
    if not older_than_s > 0:
        raise ValueError(f"older_than_s: must be > 0 seconds, got {older_than_s}")
    out = TempSweep(root=root, older_than_s=older_than_s)
    now = time.time()
    for ns in namespace_dirs(root):
        try:
            for f in fs_io.namespace_files(ns.path, tenants=True):
                if not fs_io.is_temp_name(f.name):
                    continue
                try:
                    st = f.stat(follow_symlinks=False)
                except OSError:
                    continue  # renamed into place or removed meanwhile
                age = now - st.st_mtime
                if age <= older_than_s:
                    out.kept += 1
                    continue
                out.stale.append(StaleTemp(path=f.path, bytes=st.st_size, age_s=age))
                if remove and fs_io.remove_if_stale(f, st.st_mtime, now, older_than_s):
                    out.removed += 1
                    out.removed_bytes += st.st_size
        except (FileNotFoundError, NotADirectoryError):
            continue  # the namespace directory was removed (or replaced) meanwhile
        except PermissionError as e:
            raise InspectError(
                f"{root}: cannot read {e.filename or ns.path}: permission denied"
            ) from None
    return out


def render(result: TempSweep, console, *, listing: bool) -> None:
    """Print a sweep's outcome: the orphans (listing) or what was removed."""
    from kvoffload.tools.tier_inspect import format_age, format_bytes

    age = format_age(result.older_than_s)
    if listing:
        for s in result.stale:
            console.print(
                f"{s.path}  {s.bytes:,} B  last written {format_age(s.age_s)} ago",
                highlight=False,
                soft_wrap=True,
            )
        console.print(
            f"{result.root}: {len(result.stale)} orphaned temp file(s) older than {age} "
            f"(sweep removes them); {result.kept} younger kept",
            highlight=False,
            soft_wrap=True,
        )
        return
    console.print(
        f"{result.root}: removed {result.removed} orphaned temp file(s) "
        f"({format_bytes(result.removed_bytes)}) older than {age}; "
        f"{result.kept} younger kept",
        highlight=False,
        soft_wrap=True,
    )


def sweep_roots(
    roots: list[str] | tuple[str, ...], older_than_s: float | None, *, listing: bool
) -> list[TempSweep]:
    """``kvoffload sweep --fs-root``: sweep (or with ``listing``, list) each root and print the
    outcome; ``older_than_s`` None means :data:`~kvoffload.workers.fs_io.STALE_TEMP_AGE_S`.

    Raises:
        InspectError: a root is missing or not a tier root (roots before it were swept).
        ValueError: ``older_than_s`` <= 0.
    """
    from kvoffload.tools import stdout_console

    console = stdout_console(highlight=False)
    age = fs_io.STALE_TEMP_AGE_S if older_than_s is None else older_than_s
    results = []
    for root in roots:
        result = sweep_fs_root(root, age, remove=not listing)
        render(result, console, listing=listing)
        results.append(result)
    return results
