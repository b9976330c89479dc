"""Pure judgements over a run's recorded state: no I/O, no Textual, no torch."""
