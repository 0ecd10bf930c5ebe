"""Where a server run's CPU goes: the CPU seconds of every Python process on the machine during a command,
grouped by role (API server, engine core, benchmark client), with the GPU's NVML busy share beside them.

    python scripts/dev/proc_cpu.py [--gpu-index 1] [--py-spy DIR] -- jaxkv bench serving ...

Reads ``/proc/PID/stat`` (user + system time) of every process before and after the command; a process
started during it counts from zero. A role near 100 % of the wall time (per process) is a limit at that
load; the command's own processes (the client), which end before the second look, are counted from
their resource usage instead. ``--py-spy DIR`` also samples the engine-core and API-server processes with py-spy (raw collapsed
stacks, one file per process) while the command runs. Linux only; NVML (``nvidia-ml-py``) where present.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import signal
import subprocess
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROLES = (("jaxkv.engine.core", "engine core"), ("serve.py", "API server"), ("jaxkv serve", "API server"),
         ("models.entrypoints.openai.server", "API server"), ("bench_serving", "client"), ("bench serving", "client"),
         ("multiprocessing", "client"))


def snapshot() -> dict[int, tuple[str, float]]:
    """``{pid: (role, cpu seconds)}`` of the Python processes that have a role."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        role = next((r for key, r in ROLES if key in cmd), None)
        if role is not None and "proc_cpu.py" not in cmd:
            out[int(d.name)] = (role, (int(fields[11]) + int(fields[12])) / tick)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu-index", type=int, default=None, help="NVML device (default: CUDA_VISIBLE_DEVICES' first)")
    p.add_argument("--py-spy", default=None, metavar="DIR", help="py-spy raw stacks of the cores and API servers")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    from models.benchmarks.throughput import NvmlBusySampler

    before = snapshot()
    spies = []
    if args.py_spy:
        os.makedirs(args.py_spy, exist_ok=True)
        for pid, (role, _) in before.items():
            if role in ("engine core", "API server"):
                out = os.path.join(args.py_spy, f"{role.replace(' ', '-')}-{pid}.txt")
                spies.append(subprocess.Popen(["py-spy", "record", "-p", str(pid), "-o", out, "--format", "raw",
                                               "-r", "100", "--nonblocking"],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    t0 = time.perf_counter()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    with NvmlBusySampler(args.gpu_index) as nvml:
        rc = subprocess.run(cmd).returncode
        mid = snapshot()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    waited = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
    wall = time.perf_counter() - t0
    for s in spies:
        s.send_signal(signal.SIGINT)
    for s in spies:
        try:
            s.wait(timeout=60)
        except subprocess.TimeoutExpired:
            s.kill()
    print(f"wall {wall:.2f} s; GPU busy (NVML) "
          + (f"{100 * nvml.share:.1f} %" if nvml.share is not None else nvml.reason))
    by_role: dict[str, list[float]] = {}
    for pid, (role, cpu) in mid.items():
        used = cpu - before.get(pid, (role, 0.0))[1]
        if used > 0.01:
            by_role.setdefault(role, []).append(used)
    for role, used in sorted(by_role.items()):
        print(f"{role:12s} {len(used):3d} processes, CPU {sum(used):7.2f} s; per process % of wall: "
              + " ".join(f"{100 * u / wall:.0f}" for u in sorted(used, reverse=True)[:12]))
    print(f"the command and the processes it waited for (the benchmark client): CPU {waited:.2f} s")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
