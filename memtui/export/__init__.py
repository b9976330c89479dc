"""``memtui export``: every live run on this node as Prometheus metrics (no Textual, no torch).

A subscriber like the viewer, within bounds whatever the node holds: one loop asks every
registered run for a hello and watches those that answer, up to a cap, each with the viewer's
own :class:`~memtui.runs.receiver.Receiver` and :class:`~memtui.runs.state.RunState`
(:mod:`memtui.export.fleet`); the same loop builds the metric families into a cache that a
scrape serves as it is (:mod:`memtui.export.metrics`); :mod:`memtui.export.serve` runs the loop
and :mod:`memtui.export.http` the HTTP server (a cap on connections, a deadline on requests).
"""
