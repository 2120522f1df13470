"""`python -m phalanx.bench serve | latency | throughput ...`."""

import sys

from phalanx.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
