"""``jaxkv bench serving`` from a checkout without installing the command: ``python scripts/bench_serving.py ...`` runs :mod:`models.benchmarks.serving`."""

import sys

from models.benchmarks.serving import main

if __name__ == "__main__":
    sys.exit(main())
