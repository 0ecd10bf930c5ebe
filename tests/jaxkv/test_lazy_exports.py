"""Lazy package attributes (jaxkv/_lazy.py): every public name of ``jaxkv``, ``models`` and
``models.entrypoints`` resolves to the object its module defines, and importing what a front end needs to
start an engine-core process does not import jax."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


@pytest.mark.parametrize("package", ["jaxkv", "models", "models.entrypoints"])
def test_every_export_resolves_to_its_module_object(package):
    pkg = importlib.import_module(package)
    for name in pkg.__all__:
        value = getattr(pkg, name)
        module = pkg._EXPORTS.get(name)
        if module is not None:  # the same object as the defining module's
            assert value is getattr(importlib.import_module(module), name), name
        else:  # a submodule
            assert value is importlib.import_module(f"{package}.{name}"), name
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        pkg.no_such_name  # noqa: B018


def test_starting_an_engine_core_needs_no_jax_in_the_front_end():
    code = ("import sys, jaxkv.engine.core_client, models.entrypoints.engine_args; "
            "print(sorted(m for m in ('jax', 'flax', 'pallas_kernels') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
