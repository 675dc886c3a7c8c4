"""``kvoffload top``: a live terminal monitor of a running engine or stress run.

::

    engine / stress run                           kvoffload top (one process)
    ───────────────────                           ───────────────────────────
    GET /metrics ──HTTP (urllib, in a thread)───▶ feed.fetch_snapshot() ─▶ model.Snapshot ─┐
                                                                                           ▼
                                    history of Snapshots ─▶ model.derive() ─▶ model.Stats ─▶ app tables
    PUB socket ──ZMQ (topic, seq, payload)──────▶ feed.MovementFeed.poll() ─▶ [ReceivedMovement]
                   (SUB, drained by a UI timer,          ─▶ app log, model.RouteCounter ─▶ routes table
                    never blocks)

- :mod:`.model`: the data model, plain data code tested without a terminal: a scrape as a
  :class:`~.model.Snapshot`, :func:`~.model.derive` into :class:`~.model.Stats` (gauges, counter
  rates between two scrapes, latency percentiles from histogram buckets as Prometheus'
  ``histogram_quantile`` estimates them), movements counted per route.
- :mod:`.feed`: what comes in: the metrics scrape (off the UI thread) and the movement event feed,
  decoded with :class:`kvoffload.events.MovementBatch`, the publisher's own schema.
- :mod:`.app`: the textual app and the ``top`` click command (``kvoffload top``, ``kvoffload-top``).

Every ``--interval`` seconds the exposition is fetched; a failed scrape leaves the last good values
on screen under a banner and is retried at the next interval. Importing this package imports none
of its modules (the command's module is :mod:`.app`).
"""
