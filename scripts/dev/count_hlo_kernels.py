"""Kernels per computation in XLA's optimized HLO: what one step of a compiled program launches.

    XLA_FLAGS="--xla_dump_to=/tmp/xla --xla_dump_hlo_as_text" python ...   # any run; then
    python scripts/dev/count_hlo_kernels.py /tmp/xla/*after_optimizations.txt [--min 5] [--by-name]

In XLA's optimized GPU HLO almost every op that runs on the device is a ``fusion`` (its name says its
kind: ``loop_*``, ``input_*`` reductions, ``gemm_fusion_*``, ...) or a ``custom-call`` (cuBLAS, cuDNN,
Pallas/Triton kernels); ``copy``, ``sort``, ``scatter`` and collectives launch kernels of their own, and
``parameter``, ``constant``, ``tuple``, ``get-tuple-element`` and ``bitcast`` launch none. Control flow
(``while``, ``conditional``, ``call``) runs other computations. For each computation with at least
``--min`` kernel-launching instructions this prints their number by kind: the decode loop's step is the
branch computation with a few hundred (``scripts/dev/gpu_run.sh idle1`` dumps the engine's programs).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional", "call",
        "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain"}
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_INNER_REF = re.compile(r"(?:calls|to_apply|comparator)=%?([\w.\-]+)")  # computations run inside a kernel


def _computations(text: str) -> dict[str, list[tuple[str, str, str]]]:
    """``{computation: [(instruction name, op, rest of the line)]}`` of an HLO module's text."""
    comps: dict[str, list[tuple[str, str, str]]] = {}
    current = None
    for line in text.splitlines():
        if current is None:
            m = _COMP.match(line)
            if m and "=" not in line.split("{")[0].split("(")[0]:
                current = m.group(2)
                comps[current] = []
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            comps[current].append((m.group(2), m.group(4), m.group(5)))
    return comps


def _inside_kernels(comps) -> set[str]:
    """Computations that run inside another instruction's kernel: fusion bodies (``calls=``) and the
    scalar computations of reductions, scatters and sorts (``to_apply=``, ``comparator``), and whatever
    they call in turn."""
    inner, todo = set(), []
    for instrs in comps.values():
        for _, op, rest in instrs:
            if op == "call":
                continue  # a call's computation runs its own kernels
            todo += _INNER_REF.findall(rest)
    while todo:
        c = todo.pop()
        if c in inner or c not in comps:
            continue
        inner.add(c)
        for _, _, rest in comps[c]:
            todo += _INNER_REF.findall(rest)
    return inner


def kernels_by_computation(text: str) -> dict[str, collections.Counter]:
    """``{computation: Counter(kind)}`` of the instructions that launch device work, where ``kind`` is
    the op (``custom-call`` with its target, ``fusion`` with the fusion's name up to its number);
    computations that run inside a kernel (fusion bodies, reduction scalars) are left out."""
    comps = _computations(text)
    inner = _inside_kernels(comps)
    out: dict[str, collections.Counter] = {}
    for comp, instrs in comps.items():
        if comp in inner:
            continue
        kinds = out.setdefault(comp, collections.Counter())
        for name, op, rest in instrs:
            if op in FREE:
                continue
            if op == "custom-call":
                t = re.search(r'custom_call_target="([^"]+)"', rest)
                kind = f"custom-call {t.group(1) if t else '?'}"
                k = re.search(r'"name"\s*:\s*"([^"]+)"', rest)  # Pallas/Triton kernels carry their name
                if k:
                    kind += f" {k.group(1)}"
            elif op == "fusion":
                kind = "fusion " + re.sub(r"(\.\d+)+$|_\d+$", "", name)
            else:
                kind = op
            kinds[kind] += 1
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+")
    p.add_argument("--min", type=int, default=5, help="skip computations with fewer kernels")
    p.add_argument("--by-name", action="store_true", help="list every kind, not only the 12 most frequent")
    args = p.parse_args(argv)
    for path in args.files:
        with open(path) as f:
            comps = kernels_by_computation(f.read())
        for comp, kinds in comps.items():
            n = sum(kinds.values())
            if n < args.min:
                continue
            print(f"{path.rsplit('/', 1)[-1]}  {comp}: {n} kernels")
            for kind, c in kinds.most_common(None if args.by_name else 12):
                print(f"    {c:5d}  {kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
