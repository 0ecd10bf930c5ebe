"""Child processes (engine cores, the automata compiler) import the parent's jaxkv from any working directory
(:func:`jaxkv._lazy.python_module`)."""

from __future__ import annotations

import os
import pathlib
import subprocess

from jaxkv._lazy import PACKAGE_ROOT, python_module


def test_child_imports_the_parents_jaxkv_from_a_directory_that_shadows_it(tmp_path):
    (tmp_path / "jaxkv").mkdir()
    (tmp_path / "jaxkv" / "__init__.py").write_text("raise ImportError('the working directory shadowed jaxkv')\n")
    bare = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as from a checkout never installed
    argv, env = python_module("jaxkv.engine.core", bare)
    assert argv[1:] == ["-P", "-m", "jaxkv.engine.core"] and env["PYTHONPATH"] == PACKAGE_ROOT
    code = "import jaxkv, models; print(jaxkv.__file__); print(models.__file__)"
    r = subprocess.run(argv[:2] + ["-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    files = r.stdout.split()
    assert files == [str(pathlib.Path(PACKAGE_ROOT, "jaxkv", "__init__.py")),
                     str(pathlib.Path(PACKAGE_ROOT, "models", "__init__.py"))]
    _, env2 = python_module("x", {"PYTHONPATH": "/elsewhere"})
    assert env2["PYTHONPATH"] == PACKAGE_ROOT + os.pathsep + "/elsewhere"
