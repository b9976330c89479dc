"""What the hook, the advice and the viewer compute alike: step and memory statistics, the five
knobs and their validation, the static memory of training by arithmetic (pure, no I/O)."""
