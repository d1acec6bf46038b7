import sys

from rlhf_dist.cli import main

sys.exit(main())
