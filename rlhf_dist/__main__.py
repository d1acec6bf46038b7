from __future__ import annotations

import sys

from rlhf_dist.cli import entry

sys.exit(entry())
