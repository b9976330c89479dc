"""The ``memtui`` commands, one module each; ``memtui.cli`` puts them in one group. Each imports
what it uses when it runs: importing them loads no ZeroMQ, psutil, YAML, msgspec or Textual."""
