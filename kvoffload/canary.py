"""The online correctness canary (issue 27 item 3; config ``canary``, off by default).

Wrong KV after a restore is silent: the engine generates from whatever bytes it loads. The canary
watches for it in production by asking the running server the same question twice, once able to
reuse offloaded KV and once forced to recompute, and comparing the greedy tokens::

    canary thread (scheduler's process)            vLLM front end ─▶ engine core (scheduler thread)
    ──────────────────────────────────            ─────────────────────────────────────────────────
    every every_s:                                  on_new_request(marker of a known run):
     pick the target: host, then each tier in turn    reuse run: evict its prefix from the device
     target a tier: remove the canary's chunks from     prefix cache; may load from the target only
       the host tier (TieringManager                  recompute run: loads nothing, stores nothing
       .remove_host_copies)                           prepare_load: count each chunk's source
     POST /v1/completions  salt=S,  marker ─────────▶   (TieringManager.source_of)
     POST /v1/completions  salt=S+random, marker ───▶ on_request_finished: the run is done
     compare tokens: match, mismatch (a second
       recompute confirms), not_exercised (no chunk
       loaded), unstable, error
     mismatch: log the serving tiers; fail_closed:
       TieringManager.close_loads(those tiers)

- **Where it runs.** A daemon thread of the scheduler's process, where the
  :class:`~kvoffload.tiering.TieringManager` lives: it sees which tier served each chunk and can
  close a tier's loads. It never runs on the scheduler's thread: its HTTP requests wait there,
  and the engine side only records (a dict lookup per new request carrying
  ``kv_transfer_params``, a counter per loaded batch of a canary run).
- **How its requests are recognised.** ``kv_transfer_params`` carries ``{"kvoffload_canary":
  token}``, a random token of a run the thread is waiting for (:class:`CanaryBoard`); any other
  value is ignored, so a client cannot make its own requests skip the device cache or the tiers.
- **The prompt** is a fixed list of words written three times (:func:`prompt_text`: the
  continuation is copied from far back, so it depends on the loaded KV), cut to
  ``prompt_chunks`` chunks and half a chunk of tokens (the server's ``/tokenize``, once) and sent
  as token ids: the reuse run can load exactly that many chunks. The reuse run's ``cache_salt`` is ``salt`` (its chunks live in the tiers like any
  user's, and the first check only stores them: ``not_exercised``); the recompute run's is a
  fresh one, which vLLM folds into every block hash, so nothing of it can be found anywhere.
- **Cost** per check: two requests of that prompt and ``max_tokens`` tokens (three on a
  mismatch), at most ``timeout_s`` each; counted in ``kvoffload_canary_seconds``.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvoffload.config import CanaryConfig
from kvoffload.ipc.ratelimit import RateLimitedLog

__all__ = ["MARKER", "OUTCOMES", "Canary", "CanaryBoard", "CanaryRun", "prompt_text", "verdict"]

log = logging.getLogger("kvoffload.canary")
_errors = RateLimitedLog(log)

#: The ``kv_transfer_params`` key that names a canary run.
MARKER = "kvoffload_canary"
#: A check's outcomes (the ``outcome`` label of ``kvoffload_canary_checks``).
OUTCOMES = ("match", "mismatch", "not_exercised", "unstable", "error")
HOST = "host"
REUSE, RECOMPUTE = "reuse", "recompute"
_MAX_BODY = 1 << 20
"""The most bytes of an HTTP answer read (a completion of at most 64 tokens is a few KiB)."""


class CanaryRun:
    """One request of a check, as the engine saw it: ``role`` (``reuse`` or ``recompute``),
    ``target`` (the secondary tier it may load from; None: the host tier and every tier, as
    usual), ``sources`` (chunks loaded, by the tier that served them), ``keys`` (its chunks'
    keys, looked up or stored), ``device_evicted`` (device blocks evicted for it; None: the
    scheduler could not be reached), ``done`` (set when it finished)."""

    __slots__ = ("device_evicted", "done", "keys", "role", "sources", "target")

    def __init__(self, role: str, target: str | None):
        self.role = role
        self.target = target
        self.sources: Counter[str] = Counter()
        self.keys: set[bytes] = set()
        self.device_evicted: int | None = None
        self.done = threading.Event()


class CanaryBoard:
    """The runs the canary thread waits for, found by the engine side. Thread-safe: the thread
    announces a run (:meth:`expect`) before it sends its request; the scheduler's thread claims
    it when the request arrives (:meth:`claim`), records into it and ends it
    (:meth:`finished`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._expected: dict[str, CanaryRun] = {}
        #: The runs claimed and not finished, by request id (read without the lock: a dict
        #: lookup is atomic).
        self.running: dict[str, CanaryRun] = {}

    def expect(self, role: str, target: str | None = None) -> tuple[str, CanaryRun]:
        """Announce a run; returns the token its request carries and the run."""
        token = secrets.token_hex(16)
        run = CanaryRun(role, target)
        with self._lock:
            self._expected[token] = run
        return token, run

    def withdraw(self, token: str) -> None:
        """Forget a run whose request was never claimed (it failed before reaching the engine)."""
        with self._lock:
            self._expected.pop(token, None)

    def claim(self, req_id: str, params: Any) -> CanaryRun | None:
        """The run request ``req_id`` is, from its ``kv_transfer_params`` (a dict; anything else,
        or a token of no run expected now, is no run: None)."""
        token = params.get(MARKER) if isinstance(params, dict) else None
        if not isinstance(token, str):
            return None
        with self._lock:
            run = self._expected.pop(token, None)
            if run is not None:
                self.running[req_id] = run
        return run

    def finished(self, req_id: str) -> None:
        """Request ``req_id`` finished: its run (if any) is done."""
        run = self.running.pop(req_id, None)
        if run is not None:
            run.done.set()


def verdict(
    reuse: Sequence[int],
    recompute: Sequence[int],
    loaded: int,
    recompute_again: Sequence[int] | None = None,
) -> str:
    """A check's outcome from its runs' generated token ids: ``loaded`` chunks the reuse run
    loaded from the tiers; ``recompute_again`` a second recompute's tokens (asked only when the
    first two differ). ``match``: equal, with chunks loaded; ``not_exercised``: nothing loaded
    (equal or not: then ``unstable``, two computations differed); ``mismatch``: they differ
    and the second recompute equals the first (``unstable`` if it does not, ``error`` if it was
    not given)."""
    same = list(reuse) == list(recompute)
    if not loaded:
        return "not_exercised" if same else "unstable"
    if same:
        return "match"
    if recompute_again is None:
        return "error"
    return "mismatch" if list(recompute_again) == list(recompute) else "unstable"


def prompt_text(words: int) -> str:
    """The canary's fixed prompt text: one list of ``words`` pseudo-random words, written three
    times. A model continues the third copy by copying from the second (in-context copying), so
    the tokens it generates depend on the KV of positions far back in the prompt: in the chunks
    a reuse run loads, not in the tail it computes. The same in every process and release."""
    vocab = (
        "lake copper violet harbor maple quartz falcon ember tundra orbit cedar lantern basalt "
        "willow signal marble canyon pepper glacier saddle velvet thistle comet anchor meadow "
        "cobalt ripple summit walnut beacon"
    ).split()
    out, x = [], 12345
    for _ in range(words):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(vocab[(x >> 16) % len(vocab)])
    line = " ".join(out)
    return f"{line}\n{line}\n{line}\n"


class Canary:
    """The canary's thread and its checks over one :class:`~kvoffload.tiering.TieringManager`.

    Args:
        config: the ``canary`` settings.
        tiering: the tiering manager (its ``tier_names``, ``namespace.tokens_per_chunk``,
            :meth:`~kvoffload.tiering.TieringManager.remove_host_copies`,
            :meth:`~kvoffload.tiering.TieringManager.close_loads` and counters).
        board: where the engine side finds the runs (a new one by default).

    :meth:`start` starts the thread (the first check one ``every_s`` later); :meth:`check`
    runs one check now (tests, tools); :meth:`stop` ends the thread.
    """

    def __init__(self, config: CanaryConfig, tiering: Any, board: CanaryBoard | None = None):
        self.config = config
        self.tm = tiering
        self.board = board or CanaryBoard()
        self.url = config.url.rstrip("/")
        self.targets: list[str] = [HOST, *tiering.tier_names]
        self._next = 0
        self._prompt: list[int] | None = None
        self._model = config.model
        self._keys: set[bytes] = set()
        self._reached = False  # the server answered once: a refused connection is an error
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        tiering.canary_checks.update(dict.fromkeys(OUTCOMES, 0))

    # -- the thread -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the checks' thread (a daemon: it never holds the process up)."""
        self._thread = threading.Thread(target=self._loop, name="kvoffload-canary", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 1.0) -> None:
        """End the thread: no check starts after this; one in flight is left to its daemon thread
        (its HTTP request ends at ``timeout_s`` of the config at the latest)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while not self._stop.wait(self.config.every_s):
            try:
                self.check()
            except Exception:  # never end the thread: the next check may succeed
                log.exception("kvoffload canary: a check failed unexpectedly")

    # -- one check ------------------------------------------------------------------------------

    def check(self) -> str | None:
        """Run one check now and count its outcome (:data:`OUTCOMES`); returns it. None, nothing
        counted: the server refused the connection and has never answered the canary yet (it is
        starting)."""
        t0 = time.monotonic()
        closed = set(self.tm.closed_loads)
        for _ in self.targets:  # the next target whose loads are open (if any)
            target = self.targets[self._next % len(self.targets)]
            self._next += 1
            if target not in closed:
                break
        try:
            outcome = self._check(None if target == HOST else target)
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
            # urllib's errors are OSErrors; a malformed answer a ValueError, KeyError, ...
            if not self._reached and isinstance(getattr(e, "reason", None), ConnectionRefusedError):
                # vLLM's front end listens only once the engine is up: not a failed check
                log.debug("kvoffload canary: %s not answering yet", self.url)
                self._next -= 1
                return None
            outcome = "error"
            _errors.log(
                logging.WARNING,
                type(e).__name__,
                "kvoffload canary: check of %s failed (%s: %s); counted as error",
                target,
                type(e).__name__,
                e,
            )
        self.tm.canary_checks[outcome] += 1
        self.tm.canary_seconds += time.monotonic() - t0
        return outcome

    def _check(self, target: str | None) -> str:
        prompt = self._prompt_ids()
        if target is not None and target in self.tm.closed_loads:
            return "not_exercised"  # closed by an earlier mismatch: nothing of it is loaded
        if target is not None and self._keys:
            # the host tier's copies go, so the reuse run loads from the target tier
            self.tm.remove_host_copies(self._keys, self.config.salt)
        reuse, run = self._run(prompt, self.config.salt, REUSE, target)
        self._keys |= run.keys
        loaded = sum(run.sources.values())
        recompute, _ = self._run(prompt, self._fresh_salt(), RECOMPUTE)
        again = None
        if loaded and reuse != recompute:
            again, _ = self._run(prompt, self._fresh_salt(), RECOMPUTE)
        outcome = verdict(reuse, recompute, loaded, again)
        served = ", ".join(f"{t}: {n}" for t, n in sorted(run.sources.items())) or "none"
        if outcome == "mismatch":
            self._mismatch(run, reuse, recompute, served)
        elif outcome == "unstable":
            log.warning(
                "kvoffload canary: two computations of the canary's prompt gave different "
                "tokens (%s and %s): the engine is not deterministic for it; nothing concluded",
                recompute,
                again if again is not None else reuse,
            )
        else:
            log.debug(
                "kvoffload canary: %s (target %s; chunks loaded by tier: %s; device blocks "
                "evicted: %s)",
                outcome,
                target or HOST,
                served,
                run.device_evicted,
            )
        return outcome

    def _mismatch(self, run: CanaryRun, reuse: list[int], recompute: list[int], served: str):
        # where the two differ first (or where the shorter ends)
        first = next(
            (i for i, (a, b) in enumerate(zip(reuse, recompute)) if a != b),
            min(len(reuse), len(recompute)),
        )
        tiers = sorted(run.sources)
        # the chunks found wrong leave the host tier either way (a later check recomputes them)
        self.tm.remove_host_copies(run.keys, self.config.salt)
        if self.config.fail_closed:
            closed = self.tm.close_loads(tiers)
            then = f"fail_closed: loads from {', '.join(tiers)} stopped until restart" + (
                "" if closed == tiers else f" (newly closed: {', '.join(closed) or 'none'})"
            )
        else:
            then = "fail_closed is off: those tiers still serve"
        log.error(
            "kvoffload canary: MISMATCH: the reuse run loaded chunks served by %s and generated "
            "%s where a recompute (twice) generated %s (first difference at token %d): wrong KV "
            "from %s; %s",
            served,
            reuse,
            recompute,
            first,
            ", ".join(tiers),
            then,
        )

    def _fresh_salt(self) -> str:
        return f"{self.config.salt}-{secrets.token_hex(8)}"

    def _run(
        self, prompt: list[int], salt: str, role: str, target: str | None = None
    ) -> tuple[list[int], CanaryRun]:
        token, run = self.board.expect(role, target)
        body = {
            "model": self._model,
            "prompt": prompt,
            "max_tokens": self.config.max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
            "cache_salt": salt,
            "kv_transfer_params": {MARKER: token},
        }
        try:
            answer = self._post("/v1/completions", body)
        finally:
            # a run the engine never claimed (failed before it, or sent to another data-parallel
            # rank) is forgotten; a claimed one is already out of the expected list
            self.board.withdraw(token)
        tokens = answer["choices"][0]["token_ids"]
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ValueError(f"the completion's token_ids are not a list of integers: {tokens!r}")
        # every load of the run was prepared before its first token: its sources are complete
        return tokens, run

    def _prompt_ids(self) -> list[int]:
        """The prompt's token ids, asked of the server's tokenizer once."""
        if self._model is None:
            models = self._get("/v1/models")["data"]
            self._model = str(models[0]["id"])
        if self._prompt is None:
            tpc = self.tm.namespace.tokens_per_chunk
            need = self.config.prompt_chunks * tpc + max(1, tpc // 2)
            # a list of about half the prompt, so its third copy starts inside the prompt
            words = max(4, need * 3 // 8)
            ids: list[int] = []
            for _ in range(6):  # a tokenizer with short tokens: more words
                text = prompt_text(words)
                ids = self._post("/tokenize", {"model": self._model, "prompt": text})["tokens"]
                if len(ids) >= need:
                    break
                words *= 2
            if len(ids) < need:
                raise ValueError(f"the canary's prompt is {len(ids)} tokens, {need} needed")
            self._prompt = [int(t) for t in ids[:need]]
        return self._prompt

    def _headers(self) -> dict[str, str]:
        """The request headers: JSON, and the API key from ``api_key_env`` (read at each request:
        a rotated key is used at once).

        Raises:
            ValueError: ``api_key_env`` names a variable that is not set (the value is never
                named).
        """
        headers = {"Content-Type": "application/json"}
        env = self.config.api_key_env
        if env:
            key = os.environ.get(env)
            if not key:
                raise ValueError(f"canary.api_key_env names {env}, which is not set or empty")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _post(self, path: str, body: dict) -> Any:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers=self._headers(), method="POST"
        )
        return self._send(req)

    def _get(self, path: str) -> Any:
        return self._send(urllib.request.Request(self.url + path, headers=self._headers()))

    def _send(self, req: urllib.request.Request) -> Any:
        try:
            with urllib.request.urlopen(req, timeout=self.config.timeout_s) as r:
                data = r.read(_MAX_BODY + 1)
        except urllib.error.HTTPError as e:
            self._reached = True
            detail = e.read(2048).decode("utf-8", "replace")
            raise OSError(f"{req.full_url}: HTTP {e.code}: {detail}") from None
        self._reached = True
        if len(data) > _MAX_BODY:
            raise ValueError(f"{req.full_url}: answer larger than {_MAX_BODY} bytes")
        return json.loads(data)
