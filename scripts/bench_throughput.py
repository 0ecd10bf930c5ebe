"""``jaxkv bench throughput`` from a checkout without installing the command: ``python scripts/bench_throughput.py ...`` runs :mod:`models.benchmarks.throughput`."""

import sys

from models.benchmarks.throughput import main

if __name__ == "__main__":
    sys.exit(main())
