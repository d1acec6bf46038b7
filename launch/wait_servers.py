"""Wait until every rollout server given answers /health (launch/serve_and_train.sh,
launch/slurm_serve_and_train.sh: model loading takes a while); exit 1 naming the first
that did not within --timeout seconds.

Usage: python launch/wait_servers.py [--timeout 900] URL [URL ...]
"""

from __future__ import annotations

import argparse
import sys

from rlhf_dist.generation.server import wait_healthy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("urls", nargs="+")
    args = parser.parse_args()
    for url in args.urls:
        if not wait_healthy(url, args.timeout):
            sys.exit(f"{url} did not answer /health within {args.timeout:g} s: see the server logs")


if __name__ == "__main__":
    main()
