"""``python -m memtui.demo``: run the demo training, then leave at once."""

import os
import sys

from memtui.demo.train import main

try:
    code = main()
except SystemExit as stop:  # SIGTERM (``memtui demo`` after q): main has closed what it opened
    code = stop.code if isinstance(stop.code, int) else 1
sys.stdout.flush()
sys.stderr.flush()
# main closed the loader and the hook; the interpreter's own teardown (torch's modules) took
# 1.5-2.6 s more on a 2-core machine, which `memtui demo` waited for after q
os._exit(code)
