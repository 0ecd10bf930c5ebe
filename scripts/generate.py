"""``jaxkv generate`` from a checkout without installing the command: ``python scripts/generate.py ...`` runs :mod:`models.entrypoints.cli.generate`."""

import sys

from models.entrypoints.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
