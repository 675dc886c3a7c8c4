"""Faults that ``kvoffload stress`` injects while it runs, and the setup some of them need.

- ``kill_workers``: SIGKILL a random tier worker process every ``kill_every_s`` (the pool must fail or
  re-run its jobs and start a replacement).
- ``corrupt``: every ``corrupt_every_s``, damage one stored chunk of a random fs or obj tier: flip
  payload bytes, truncate it, or delete it (loads must turn into misses, never wrong bytes).
- ``fill_disk``: the fs tiers run in a small tmpfs (:func:`small_tmpfs`, root only); every
  ``fill_every_s`` a ballast file takes all its free space for ``fill_hold_s`` seconds, and on until
  a store has met the full disk (at most ``max_hold_s``), so the fault is exercised however slow the
  machine (stores fail with ``no_space`` and are dropped; nothing crashes; space comes back).
- ``flaky_s3``: each obj tier talks to its endpoint through a
  :class:`~kvoffload.tools.faultproxy.FaultProxy` that answers some requests with 503 SlowDown or
  500, delays some, drops some connections, and goes dead for ``s3_outage_s`` every
  ``s3_outage_every_s``, and on until each obj tier's breaker has opened and dropped a store (at most
  ``max_hold_s``; the breaker must open, and close again).

Every injected fault is counted in :attr:`FaultInjector.injected` for the stress summary.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import tempfile
import time
from collections import Counter
from typing import Any

from kvoffload.ipc import names
from kvoffload.workers import chunkfile as cf


class FaultError(RuntimeError):
    """A fault cannot be set up here (e.g. ``--fill-disk`` without root)."""


@contextlib.contextmanager
def small_tmpfs(size_bytes: int):
    """Mount a tmpfs of ``size_bytes`` on a new temporary directory; unmount and remove it after.

    Raises:
        FaultError: not root, or the mount failed.
    """
    if os.geteuid() != 0:
        raise FaultError("--fill-disk mounts a small tmpfs for the fs tiers, which needs root")
    path = tempfile.mkdtemp(prefix="kvoffload-stress-tmpfs-")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", path],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        os.rmdir(path)
        raise FaultError(f"--fill-disk: mount -t tmpfs failed: {r.stderr.strip()}")
    try:
        yield path
    finally:
        for _ in range(50):
            if subprocess.run(["umount", path], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)  # a worker still closing a file
        else:
            subprocess.run(["umount", "-l", path], capture_output=True)
        with contextlib.suppress(OSError):
            os.rmdir(path)


class FaultInjector:
    """Injects the enabled faults into a running :class:`~kvoffload.tiering.TieringManager`.

    Call :meth:`tick` from the stress loop (it returns at once unless a fault is due).
    """

    def __init__(
        self,
        tm: Any,
        *,
        kill_workers: bool = False,
        corrupt: bool = False,
        fill_disk_dir: str | None = None,
        proxies: dict[str, Any] | None = None,
        upstreams: dict[str, str] | None = None,
        seed: int = 0,
        kill_every_s: float = 2.0,
        corrupt_every_s: float = 0.5,
        fill_every_s: float = 6.0,
        fill_hold_s: float = 2.0,
        s3_outage_every_s: float = 15.0,
        s3_outage_s: float = 3.0,
        max_hold_s: float = 30.0,
    ):
        self.tm = tm
        self._max_hold_s = max_hold_s
        self._enabled = {
            "kill-workers": kill_workers,
            "corrupt": corrupt,
            "fill-disk": bool(fill_disk_dir),
            "flaky-s3": bool(proxies),
        }
        self.rng = random.Random(seed)
        self.injected: Counter[str] = Counter()
        now = time.monotonic()
        self._plan: list[list] = []  # [due, period, action]
        if kill_workers:
            self._plan.append([now + kill_every_s, kill_every_s, self._kill_worker])
        if corrupt:
            self._plan.append([now + corrupt_every_s, corrupt_every_s, self._corrupt_one])
        self.fill_dir = fill_disk_dir
        self._fill_hold_s = fill_hold_s
        self._ballast: str | None = None
        self._ballast_until = 0.0
        self._ballast_max_until = 0.0
        self._no_space_before = 0
        if fill_disk_dir:
            self._plan.append([now + fill_every_s / 2, fill_every_s, self._fill])
        self.proxies = proxies or {}
        self.upstreams = upstreams or {}  # obj tier name -> the store behind its proxy
        self._outage_s = s3_outage_s
        self._outage_until: float | None = None
        self._outage_max_until = 0.0
        self._dropped_before: dict[str, int] = {}
        if self.proxies:
            self._plan.append([now + s3_outage_every_s / 2, s3_outage_every_s, self._s3_outage])
        self._files: dict[str, list[str]] = {}
        self._files_at = 0.0

    def tick(self, now: float) -> None:
        if (
            self._ballast is not None
            and now >= self._ballast_until
            and (self._no_space() > self._no_space_before or now >= self._ballast_max_until)
        ):
            self._release_ballast()
        if (
            self._outage_until is not None
            and now >= self._outage_until
            and (
                all(self._breaker_dropped(n) > self._dropped_before.get(n, 0) for n in self.proxies)
                or now >= self._outage_max_until
            )
        ):
            for proxy in self.proxies.values():
                proxy.start()
            self._outage_until = None
        for item in self._plan:
            if now >= item[0]:
                item[0] = now + item[1] * self.rng.uniform(0.5, 1.5)
                item[2](now)

    def close(self) -> None:
        """Undo what is still in effect (ballast, an outage) and add the proxies' fault counts."""
        self._release_ballast()
        if self._outage_until is not None:
            for proxy in self.proxies.values():
                proxy.start()
            self._outage_until = None
        for proxy in self.proxies.values():
            for rule in proxy.rules:
                a = rule.action
                what = f"s3_{a[1]}" if a[0] == "status" else f"s3_{a[0]}"
                self.injected[what] += rule.hits
            proxy.rules.clear()

    # -- faults ---------------------------------------------------------------------------------

    def _kill_worker(self, now: float) -> None:
        pids = [
            (t.name, pid)
            for t in self.tm.tiers
            if hasattr(t, "worker_pids")
            for pids in t.worker_pids().values()
            for pid in pids
        ]
        if not pids:
            return
        name, pid = self.rng.choice(pids)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            self.injected["worker_killed"] += 1

    def _chunk_files(self, root: str, now: float) -> list[str]:
        if now - self._files_at > 2.0 or root not in self._files:
            found = []
            for d, _, files in os.walk(root):
                found.extend(os.path.join(d, f) for f in files if f.endswith(cf.SUFFIX))
                if len(found) > 5000:
                    break
            self._files[root] = found
            self._files_at = now
        return self._files[root]

    def _corrupt_one(self, now: float) -> None:
        targets = [t for t in self.tm.tiers if type(t).__name__ in ("FsTier", "ObjTier")]
        if not targets:
            return
        tier = self.rng.choice(targets)
        how = self.rng.choice(("corrupt", "truncate", "delete"))
        if type(tier).__name__ == "FsTier":
            files = self._chunk_files(tier.config.root_dir, now)
            if not files:
                return
            path = files.pop(self.rng.randrange(len(files)))
            try:
                if how == "delete":
                    os.unlink(path)
                elif how == "truncate":
                    os.truncate(path, os.path.getsize(path) // 2)
                else:
                    with open(path, "r+b") as f:
                        f.seek(cf.HEADER_BYTES + self.rng.randrange(64))
                        f.write(os.urandom(16))
            except OSError:
                return  # evicted or replaced meanwhile
        else:
            if not self._damage_object(tier, how):
                return
        self.injected[f"chunk_{how}d" if how != "corrupt" else "chunk_corrupted"] += 1

    def _damage_object(self, tier: Any, how: str) -> bool:
        clients = self.__dict__.setdefault("_s3", {})
        if tier.name not in clients:
            import msgspec

            from kvoffload.workers.obj_io import ObjIOConfig, make_client

            io_cfg = msgspec.structs.replace(
                tier.io_config(),
                endpoint_url=self.upstreams.get(tier.name, tier.config.endpoint_override),
                max_attempts=1,
            )
            assert isinstance(io_cfg, ObjIOConfig)
            clients[tier.name] = (make_client(io_cfg), io_cfg)
        client, cfg = clients[tier.name]
        from kvoffload.workers.obj_io import object_prefix

        prefix = object_prefix(cfg.prefix, cfg.namespace_id)
        bucket = cfg.bucket
        try:
            listing = client.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=200)
            keys = [o["Key"] for o in listing.get("Contents", []) if o["Key"].endswith(cf.SUFFIX)]
            if not keys:
                return False
            name = self.rng.choice(keys)
            if how == "delete":
                client.delete_object(Bucket=bucket, Key=name)
            else:
                body = client.get_object(Bucket=bucket, Key=name)["Body"].read()
                if how == "truncate":
                    body = body[: len(body) // 2]
                else:
                    body = body[: cf.HEADER_BYTES] + os.urandom(16) + body[cf.HEADER_BYTES + 16 :]
                client.put_object(Bucket=bucket, Key=name, Body=body)
            return True
        except Exception:
            return False

    def _fill(self, now: float) -> None:
        if self._ballast is not None:
            return
        path = os.path.join(self.fill_dir, "ballast")
        st = os.statvfs(self.fill_dir)
        free = st.f_bavail * st.f_frsize
        if free <= 0:
            return
        try:
            fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
            try:
                os.posix_fallocate(fd, 0, free)
            except OSError:
                pass  # took what it could
            finally:
                os.close(fd)
        except OSError:
            return
        self._ballast = path
        self._ballast_until = now + self._fill_hold_s
        self._ballast_max_until = now + max(self._fill_hold_s, self._max_hold_s)
        self._no_space_before = self._no_space()
        self.injected["disk_filled"] += 1

    def _release_ballast(self) -> None:
        if self._ballast is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._ballast)
            self._ballast = None

    def _s3_outage(self, now: float) -> None:
        if self._outage_until is not None:
            return
        for proxy in self.proxies.values():
            proxy.stop()
        self._outage_until = now + self._outage_s
        self._outage_max_until = now + max(self._outage_s, self._max_hold_s)
        self._dropped_before = {n: self._breaker_dropped(n) for n in self.proxies}
        self.injected["s3_outage"] += 1

    def unexercised(self) -> list[str]:
        """The enabled faults not yet seen to take effect, by their flag names: ``kill-workers`` until
        a killed worker was replaced, ``corrupt`` until a load refused a damaged or missing chunk,
        ``fill-disk`` until a store met the full disk, ``flaky-s3`` until an injected S3 error was
        answered and every obj tier's breaker dropped a store during an outage."""
        seen = {
            "kill-workers": lambda: any(
                t.counters.get(names.WORKER_RESTARTS, 0)
                for t in self.tm.tiers
                if hasattr(t, "worker_pids")
            ),
            "corrupt": lambda: any(
                v
                for (_, direction, reason), v in self.tm.stats.failed.items()
                if direction == "load" and reason in ("corrupt", "missing")
            ),
            "fill-disk": lambda: self._no_space() > 0,
            "flaky-s3": lambda: (
                any(
                    r.hits
                    for p in self.proxies.values()
                    for r in p.rules
                    if r.action[0] == "status"
                )
                and all(self._breaker_dropped(n) for n in self.proxies)
            ),
        }
        return [name for name, on in self._enabled.items() if on and not seen[name]()]

    def metric_evidence(self) -> dict[str, dict[str, float]]:
        """For each enabled fault (by flag name), the non-zero series of this process's ``/metrics``
        exposition that show it, as ``{'name{label="v",...}': value}``; an empty dict is a fault that
        was injected and that no metric shows. Read from the registry :func:`kvoffload.metrics.serve`
        exports, so what is here is what a scrape sees (call it before the manager shuts down).

        kill-workers: ``kvoffload_tier_worker_restarts_total``; corrupt: load failures with reason
        ``corrupt`` or ``missing``; fill-disk: store failures with reason ``no_space``; flaky-s3: the
        obj tier's S3 retries (``kvoffload_tier_events_total{event="retries"}``) and stores its open
        breaker refused (``kvoffload_refused_chunks_total{reason="breaker_open"}``), both needed.
        """
        from prometheus_client import generate_latest
        from prometheus_client.parser import text_string_to_metric_families

        from kvoffload import metrics

        text = generate_latest(metrics.registry()).decode()
        samples = [
            smp
            for fam in text_string_to_metric_families(text)
            for smp in fam.samples
            if smp.value > 0
        ]
        obj = set(self.proxies)

        def pick(name: str, **want) -> dict[str, float]:
            out = {}
            for smp in samples:
                if smp.name != name:
                    continue
                if all(
                    smp.labels.get(k) in (v if isinstance(v, (set, tuple)) else (v,))
                    for k, v in want.items()
                ):
                    labels = ",".join(
                        f'{k}="{v}"' for k, v in sorted(smp.labels.items()) if k != "instance"
                    )  # one manager per stress run
                    out[f"{smp.name}{{{labels}}}"] = smp.value
            return out

        def both(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
            return {**a, **b} if a and b else {}

        rules = {
            "kill-workers": lambda: pick("kvoffload_tier_worker_restarts_total"),
            "corrupt": lambda: pick(
                "kvoffload_tier_failed_chunks_total",
                direction="load",
                reason=("corrupt", "missing"),
            ),
            "fill-disk": lambda: pick(
                "kvoffload_tier_failed_chunks_total", direction="store", reason="no_space"
            ),
            "flaky-s3": lambda: both(
                pick("kvoffload_tier_events_total", tier=obj, event=names.RETRIES),
                pick("kvoffload_refused_chunks_total", tier=obj, reason="breaker_open"),
            ),
        }
        return {name: rules[name]() for name, on in self._enabled.items() if on}

    def _no_space(self) -> int:
        """Chunks whose store failed for want of disk space, all tiers, so far."""
        return sum(
            v
            for (_, direction, reason), v in self.tm.stats.failed.items()
            if direction == "store" and reason == "no_space"
        )

    def _breaker_dropped(self, tier_name: str) -> int:
        """Stores that tier ``tier_name``'s open breaker has dropped so far."""
        return sum(
            int(t.counters.get("breaker_dropped_stores", 0))
            for t in self.tm.tiers
            if t.name == tier_name
        )


def flaky_rules() -> list:
    """The steady faults of ``--flaky-s3``: 3% 503 SlowDown, 1% 500, 2% delayed 0.3 s, 0.5% dropped."""
    from kvoffload.tools.faultproxy import Rule

    return [
        Rule("*", "", ("status", 503, "SlowDown"), probability=0.03),
        Rule("*", "", ("status", 500, "InternalError"), probability=0.01),
        Rule("*", "", ("delay", 0.3), probability=0.02),
        Rule("*", "", ("drop",), probability=0.005),
    ]
