"""Child Python processes of jaxkv (engine cores, the structured outputs' automata compiler) that import the same
``jaxkv`` as their parent, wherever they are started from."""

from __future__ import annotations

import os
import pathlib
import sys

PACKAGE_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
"""The directory holding the ``jaxkv`` package this process imported (and ``models`` in a source checkout)."""


def python_module(module: str, env: dict | None = None) -> tuple[list[str], dict]:
    """``(argv, env)`` to run ``python -P -m module`` in a child process.

    ``-P`` keeps the child's working directory off ``sys.path``: a folder named ``jaxkv`` there (``tests/`` has one)
    would shadow the package. :data:`PACKAGE_ROOT` goes first on ``PYTHONPATH`` instead, so a source checkout that
    was never installed still imports, and the child runs the parent's code, not another copy on its path.
    ``env``: the child's environment (default: this process's).
    """
    env = dict(os.environ if env is None else env)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = PACKAGE_ROOT + (os.pathsep + path if path else "")
    return [sys.executable, "-P", "-m", module], env
