"""The viewer's widgets, one per file; each renders from the RunState, never from a socket."""
