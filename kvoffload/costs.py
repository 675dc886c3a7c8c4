"""What a load from a tier and a recompute cost: the live estimates and the decisions on them.

::

    tier load jobs end ──▶ TierLoadCost.ended, .sample per poll: bytes over the tier's busy time
    engine step ends ────▶ RateEstimate.observe(tokens, seconds)  (vLLM: tokens the step scheduled)
    lookup, tier HIT ────▶ load_beats_recompute(the chunk's bytes at the tier's rate, its recompute)
                             False ─▶ MISS: the tier is slower than prefill; the engine recomputes
    promotion submitted ─▶ load_beats_recompute(the request's chunks from the tier this step,
                           behind what it has outstanding, at least a job's fixed cost, against
                           their recompute): False ─▶ the request gives way (MISS from its first
                           chunk; the load goes on and lands in the host tier);
                           promotion_deadline(...): past it (and past two steps), lookups of
                           its chunks answer MISS; the load goes on and publishes when it lands

"Never slower than recompute" (issue 26): a tier serves only the part of a prefix whose load is
expected to beat recomputing it, and a promotion that overruns gives way to a recompute. Every
estimate starts unknown, and while either side of a comparison is unknown the chunk is served as
before: a tier is never judged on no evidence.

The :class:`~kvoffload.tiering.TieringManager` owns one :class:`TierLoadCost` per secondary tier
and one prefill :class:`RateEstimate`; this module is pure (no clock, no I/O), so its decisions
are tested as functions.
"""

from __future__ import annotations

SMOOTHING = 0.2
"""Weight of the newest sample in an exponentially weighted estimate (the last ~5 samples
dominate)."""


class RateEstimate:
    """A live rate (units per second) from ``(amount, seconds)`` samples: the ratio of an
    exponentially weighted amount to an exponentially weighted duration, so a large sample
    weighs more than a tiny one (a one-chunk job's fixed cost does not swamp the rate).

    Args:
        smoothing: weight of the newest sample, in (0, 1].
        fixed: a configured rate (units/s) that replaces every observation (an operator's
            override); None: live.
    """

    __slots__ = ("_amount", "_seconds", "fixed", "samples", "smoothing")

    def __init__(self, smoothing: float = SMOOTHING, fixed: float | None = None):
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.smoothing = smoothing
        self.fixed = fixed
        self._amount = 0.0
        self._seconds = 0.0
        self.samples = 0  # observations taken (not counting those ignored)

    def observe(self, amount: float, seconds: float) -> None:
        """One sample: ``amount`` units (bytes, tokens) took ``seconds``. Samples with nothing
        moved or no time are ignored (they say nothing about the rate)."""
        if amount <= 0 or seconds <= 0:
            return
        if self.samples == 0:
            self._amount, self._seconds = float(amount), float(seconds)
        else:
            a = self.smoothing
            self._amount += a * (amount - self._amount)
            self._seconds += a * (seconds - self._seconds)
        self.samples += 1

    @property
    def rate(self) -> float | None:
        """Units per second; None while nothing has been observed (and nothing configured)."""
        if self.fixed is not None:
            return self.fixed
        if self.samples == 0:
            return None
        return self._amount / self._seconds

    def seconds_for(self, amount: float) -> float | None:
        """Expected seconds for ``amount`` units at :attr:`rate`; None while it is unknown."""
        r = self.rate
        return None if r is None else amount / r


class TierLoadCost:
    """What a load from one secondary tier costs: its load throughput (bytes/s), a job's fixed
    cost, and the bytes of the loads it has been given and not finished (in flight, or queued
    this step).

    The throughput is the tier's, not a job's: the bytes finished over the time the tier was busy
    with loads, sampled once per poll of its results (:meth:`sample`): from the moment it had a
    load outstanding, then from one poll that read a result to the next, so jobs that overlap
    are not each charged the time they spent queued behind the others, results read in the same
    poll are one sample, and idle time is never charged. (A job's own submit-to-result rate falls
    with every job queued beside it: taken as the tier's rate, with the queue added on top, a
    busy healthy tier was judged many times slower than it is and a healthy fs tier stopped
    serving under load: ``bench scaling``, BENCHMARKS §6.) A sample ends when the tier says the
    last of its results ended (``JobResult.done_at``), else when the engine read them: results
    are read once per scheduler step, and a tier fed one small job per long prefill step would
    look as slow as the steps. A load that timed out is a sample of its own:
    its bytes over its own time (at least the timeout). The fixed cost of a job (round trips and
    scheduler steps before its bytes move) is learnt from jobs started while the tier had none
    outstanding, whose time held no queue.

    Before the tier's first load, its stores' throughput stands in for the deadlines of its
    first promotions (the only evidence there is; a deadline is never shorter than the recompute
    it guards, so a slow stand-in only waits longer, as before). A lookup judges a tier on its
    loads only (the tiering manager): stores queued behind a write-through backlog say nothing
    of what a load costs.
    """

    __slots__ = (
        "_busy_from",
        "_done_at",
        "_ended",
        "_unsampled",
        "job_seconds",
        "loads",
        "outstanding_bytes",
        "smoothing",
        "stores",
    )

    def __init__(self, smoothing: float = SMOOTHING):
        self.smoothing = smoothing
        self.loads = RateEstimate(smoothing)
        self.stores = RateEstimate(smoothing)
        #: Bytes of load jobs submitted to the tier and not finished.
        self.outstanding_bytes = 0.0
        #: Seconds a load job takes on an idle tier whatever its size (exponentially weighted;
        #: None: none yet): the floor of any job's expected time, for a tier whose jobs cost
        #: round trips and scheduler steps before their bytes move (p2p: a lease, then the
        #: transfer).
        self.job_seconds: float | None = None
        self._busy_from = 0.0  # when the interval the next sample covers began
        self._unsampled = 0.0  # bytes finished since the last sample
        self._ended = False  # a job ended since the last sample
        self._done_at = 0.0  # the latest end the tier reported since (-1.0: one did not say)

    def started(self, nbytes: float, now: float) -> bool:
        """A load job of ``nbytes`` bytes was submitted at ``now`` (seconds, monotonic). Returns
        whether the tier had none outstanding: the job's time is then the tier's latency, with
        nothing queued ahead of it (pass it back to :meth:`ended`)."""
        alone = self.outstanding_bytes <= 0
        if alone:
            self._busy_from = now
            self._unsampled = 0.0
        self.outstanding_bytes += nbytes
        return alone

    def ended(
        self,
        nbytes: float,
        moved: float | None = None,
        seconds: float = 0.0,
        alone: bool = False,
        timed_out: bool = False,
        done_at: float = 0.0,
    ) -> None:
        """A load job :meth:`started` with ``nbytes`` ended (its result was read; call
        :meth:`sample` once the poll's results are applied). ``moved``: the bytes it is
        evidence for (a success: the bytes it loaded; a timeout: its bytes), None when it says
        nothing of the tier's speed (a fast failure, a missing chunk, a job a reset forgot).
        ``seconds``: its submit-to-result time; ``alone``: what :meth:`started` returned for it;
        ``timed_out``: its bytes took at least ``seconds`` (a sample of their own); ``done_at``:
        when the tier says it finished (same clock as :meth:`started`; 0.0: not known), so
        the sample ends then rather than when the engine read the result (once per scheduler
        step: a tier fed one small job per step would look no faster than the steps)."""
        self.outstanding_bytes -= nbytes
        if not self._ended:
            self._ended, self._done_at = True, 0.0
        if self._done_at >= 0.0:
            self._done_at = max(self._done_at, done_at) if done_at > 0.0 else -1.0
        if moved is None:
            return
        if timed_out:
            self.loads.observe(moved, seconds)
            return
        self._unsampled += moved
        if alone and seconds > 0:
            j = self.job_seconds
            self.job_seconds = seconds if j is None else j + self.smoothing * (seconds - j)

    def sample(self, now: float) -> None:
        """The results of one poll have been applied (at ``now``): the bytes they finished over
        the time since the previous sample (or since the tier became busy) up to when the tier
        said the last of them ended (``done_at``; ``now`` when one did not say) are one sample
        of the throughput."""
        if not self._ended:
            return
        self._ended = False
        end = self._done_at if self._done_at > self._busy_from else now
        end = min(end, now)
        if end > self._busy_from:
            if self._unsampled > 0:
                self.loads.observe(self._unsampled, end - self._busy_from)
                self._unsampled = 0.0
            self._busy_from = end

    @property
    def bytes_per_s(self) -> float | None:
        """The load throughput (bytes/s): loads', else stores', else None (unknown)."""
        r = self.loads.rate
        return self.stores.rate if r is None else r

    def expected_s(self, nbytes: float, queued_bytes: float = 0.0) -> float | None:
        """Seconds a load of ``nbytes`` is expected to take behind what the tier already has
        (:attr:`outstanding_bytes`) and ``queued_bytes`` more (queued, not yet submitted), and
        at least a job's usual time (:attr:`job_seconds`); None while the throughput is
        unknown."""
        r = self.bytes_per_s
        if r is None:
            return None
        return max((self.outstanding_bytes + queued_bytes + nbytes) / r, self.job_seconds or 0.0)


def load_beats_recompute(load_s: float | None, recompute_s: float | None, margin: float) -> bool:
    """Whether chunks expected to take ``load_s`` seconds to load should be loaded rather than
    recomputed in ``recompute_s`` seconds: unless the load is expected to take more than
    ``margin`` times the recompute. True while either estimate is unknown (None): no evidence,
    no change."""
    if load_s is None or recompute_s is None:
        return True
    return load_s <= margin * recompute_s


def promotion_deadline(
    submitted_at: float,
    load_s: float | None,
    recompute_s: float | None,
    overrun: float,
    margin: float,
) -> float | None:
    """When a promotion submitted at ``submitted_at`` (seconds, any monotonic clock) has overrun:
    once it has taken ``overrun`` times its expected load (``load_s``), or ``margin`` times the
    recompute of the chunks it brings (``recompute_s``) if that comes first: a request never
    waits for a load longer than a lookup would have let it (:func:`load_beats_recompute`), and
    a stalled healthy tier costs it a fraction of a recompute. None (never overruns) while
    either estimate is unknown."""
    if load_s is None or recompute_s is None:
        return None
    return submitted_at + min(overrun * load_s, margin * recompute_s)
