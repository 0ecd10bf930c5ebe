"""``jaxkv serve`` from a checkout without installing the command: ``python scripts/serve.py ...`` runs :mod:`models.entrypoints.openai.server`."""

import sys

from models.entrypoints.openai.server import main

if __name__ == "__main__":
    sys.exit(main())
