"""``memtui export``: every live run on this node as Prometheus metrics (no Textual, no torch).

A subscriber like the viewer: one :class:`~memtui.tui.receiver.Receiver` per run folds the run's
telemetry into a :class:`~memtui.tui.state.RunState` (:mod:`memtui.export.fleet`), and a
prometheus-client collector builds the metric families from them at each scrape
(:mod:`memtui.export.metrics`); :mod:`memtui.export.serve` runs the HTTP server.
"""
