"""``python -m memtui``: the command line."""

from memtui.cli import main

main()
