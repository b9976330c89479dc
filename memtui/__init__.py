"""memtui: live memory and data-starvation tuning for training runs."""

__version__ = "0.1.0"
