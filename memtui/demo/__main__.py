"""``python -m memtui.demo``: run the demo training."""

import sys

from memtui.demo.train import main

sys.exit(main())
