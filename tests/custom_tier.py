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
