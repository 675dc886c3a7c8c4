"""An out-of-tree tier for tests: the memory tier plus metrics of its own (declared, not wired)."""

from kvoffload.metrics import Counter, Gauge, Histogram
from kvoffload.tiers.memory import MemoryTier


class CountingTier(MemoryTier):
    metric_definitions = (
        Counter("kvoffload_counting_stores", "Store jobs seen by the counting tier.", ("tier",)),
        Gauge("kvoffload_counting_chunks", "Chunks held by the counting tier.", ("tier",)),
        Histogram(
            "kvoffload_counting_job_chunks",
            "Chunks per store job.",
            ("tier",),
            buckets=(1, 2, 4, 8, 16),
        ),
    )

    def submit_store(self, job):
        super().submit_store(job)
        self.count("kvoffload_counting_stores")  # a declared counter: goes to the metric
        self.count(
            "custom_event"
        )  # not declared: kvoffload_tier_events_total{event="custom_event"}
        self.metrics.observe("kvoffload_counting_job_chunks", len(job.keys), self.name)

    def report_metrics(self, metrics):
        metrics.set("kvoffload_counting_chunks", len(self._chunks), self.name)


class PeerMediumTier(MemoryTier):
    """The memory tier declaring itself a peer medium (``"PEER"``), as the p2p tier does: a peer's
    lookup (``TieringManager.serve_lookup``) must never be answered from it."""

    medium = "PEER"


class RoutedMemoryTier(MemoryTier):
    """The memory tier with every routed-tier hook (:class:`~kvoffload.tiers.base.RoutedTier`):
    it records what the manager tells it and stores only requests routed to it
    (``{"to_tier": True}`` in their ``kv_transfer_params``)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.attached = None
        self.told: list[tuple[str, object]] = []
        self.finished: list[str] = []
        self._routed: set[str] = set()

    def attach(self, manager):
        self.attached = manager

    def on_request(self, req_id, kv_transfer_params):
        self.told.append((req_id, kv_transfer_params))
        if kv_transfer_params and kv_transfer_params.get("to_tier"):
            self._routed.add(req_id)

    def on_request_finished(self, req_id):
        self.finished.append(req_id)
        self._routed.discard(req_id)

    def origin(self, key):
        return "10.0.0.7:5555"

    def wants_store(self, req_id):
        return req_id in self._routed


class HalfRoutedTier(MemoryTier):
    """A tier written against an older contract: two routed-tier hooks of five."""

    def on_request(self, req_id, kv_transfer_params):
        pass

    def wants_store(self, req_id):
        return False
