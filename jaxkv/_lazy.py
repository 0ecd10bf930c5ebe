"""How jaxkv's code gets imported: lazy package attributes, and child processes that import this same jaxkv.

Lazy package attributes (PEP 562): a package's public names are imported on first use. A front-end process (the
server's API servers, ``LLM``'s caller) imports ``jaxkv.engine.core_client`` and a few model-name helpers; with
eager package ``__init__``s that pulled in jax, flax and every kernel (~1.7 s on the CPU machine) before the
engine-core process could even be started.

Child Python processes (engine cores, the structured outputs' automata compiler): :func:`python_module`.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import sys
from typing import Callable

PACKAGE_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
"""The directory holding the ``jaxkv`` package this process imported (and ``models`` in a source checkout)."""


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps a public name to the module defining it;
    any other name is tried as a submodule (``jaxkv.parallel``). The value is cached on the package.

    Raises (from ``__getattr__``):
        AttributeError: neither an export nor a submodule.
    """

    def __getattr__(name: str):
        module = exports.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
        else:
            try:
                value = importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(exports) | set(vars(sys.modules[package])))

    return __getattr__, __dir__


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
