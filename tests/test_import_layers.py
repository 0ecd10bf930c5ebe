"""The import contract, read from the source (AST, no imports run).

Packages: ``pallas_kernels`` <- ``jaxkv`` <- ``models`` <- ``scripts`` (an arrow points from what is
imported to its importer); ``models`` reaches the kernels only through ``jaxkv``. Inside ``jaxkv`` the
folders are layers, each importing only lower ones (docs/architecture.md):

    flat modules (checks, config, sampling_params, outputs) <- kv_cache, ops <- attention, core <- parallel
    <- worker <- engine;  vllm_parity imports what it needs and nothing imports it

``attention`` and ``core`` are siblings (the device's read of the cache, the host's bookkeeping): neither
imports the other. Every import counts, also one inside a function. The module-level imports of the
three packages form no cycle.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_kernels", "jaxkv", "models", "scripts")

# jaxkv's layers: a module may import its own folder and lower layers only
JAXKV_LAYERS = {
    "jaxkv._lazy": 0, "jaxkv.checks": 0, "jaxkv.config": 0, "jaxkv.sampling_params": 0, "jaxkv.outputs": 0,
    "jaxkv.kv_cache": 1, "jaxkv.ops": 1,
    "jaxkv.attention": 2, "jaxkv.core": 2,
    "jaxkv.parallel": 3,
    "jaxkv.worker": 4,
    "jaxkv.engine": 5,
    "jaxkv.vllm_parity": 6,
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(path: pathlib.Path) -> list[tuple[str, int, bool]]:
    """``(imported module, line, at module level)`` for every project import of ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES:
                found.append((name, node.lineno, id(node) in top))
    return found


def _resolve(name: str, sources: dict) -> str | None:
    """The longest prefix of ``name`` that is a module of the tree (``from a.b import c``: ``a.b.c`` when ``c``
    is a module, else ``a.b``)."""
    while name and name not in sources:
        name = name.rpartition(".")[0]
    return name or None


def _layer(module: str) -> tuple[str, int] | None:
    for prefix, rank in sorted(JAXKV_LAYERS.items(), key=lambda kv: -len(kv[0])):
        if module == prefix or module.startswith(prefix + "."):
            return prefix, rank
    return None


def _violations() -> list[str]:
    sources = _sources()
    order = {pkg: i for i, pkg in enumerate(PACKAGES)}
    bad = []
    for module, path in sources.items():
        src_pkg = module.split(".")[0]
        for name, line, _ in _imports(path):
            target = _resolve(name, sources)
            if target is None:
                continue
            where = f"{path.relative_to(ROOT)}:{line} imports {target}"
            dst_pkg = target.split(".")[0]
            if order[dst_pkg] > order[src_pkg]:
                bad.append(f"{where}: {src_pkg} may not import {dst_pkg}")
            if src_pkg == "models" and dst_pkg == "pallas_kernels":
                bad.append(f"{where}: models reaches the kernels through jaxkv")
            if src_pkg == "jaxkv" == dst_pkg and module != "jaxkv":
                src, dst = _layer(module), _layer(target)
                if src is None or dst is None:
                    bad.append(f"{where}: {module if src is None else target} is in no layer of JAXKV_LAYERS")
                elif src[0] != dst[0] and dst[1] >= src[1]:
                    bad.append(f"{where}: layer {src[0]} ({src[1]}) may not import layer {dst[0]} ({dst[1]})")
    return bad


def _cycles() -> list[list[str]]:
    sources = _sources()
    graph = {m: sorted({t for n, _, top in _imports(p) if top for t in [_resolve(n, sources)] if t and t != m})
             for m, p in sources.items() if m.split(".")[0] != "scripts"}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def strongconnect(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            strongconnect(v)
    return cycles


def test_packages_and_jaxkv_layers_import_downwards_only():
    assert _violations() == []


def test_no_import_cycles():
    assert _cycles() == []


def test_the_checker_sees_a_wrong_way_import(tmp_path, monkeypatch):
    """The rules above catch an engine import from the KV-cache layer and a cycle (checked on a copy)."""
    import shutil
    import sys

    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    specs = tmp_path / "jaxkv" / "kv_cache" / "specs.py"
    specs.write_text(specs.read_text() + "\nfrom jaxkv.engine.llm_engine import LLMEngine\n")
    assert any("layer jaxkv.kv_cache (1) may not import layer jaxkv.engine (5)" in v for v in _violations())
    assert any("jaxkv.kv_cache.specs" in c for c in _cycles())


@pytest.mark.parametrize("package", ["jaxkv"])
def test_few_flat_modules(package):
    """``jaxkv``'s modules live in folders by concern; at most six stay flat (``__init__`` included)."""
    flat = sorted(p.name for p in (ROOT / package).glob("*.py"))
    assert len(flat) <= 6, flat
