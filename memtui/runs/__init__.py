"""The run model: what a live or replayed run is, as the viewer, the exporter and ``memtui status``
read it (the receiver that turns frames into batches, the state they fold into, the checks on
what a run may send), with no Textual, Rich or torch."""
