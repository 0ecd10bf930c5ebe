"""CPU time of the API-server process per output token and per request, under a rate-inf load from the
official ``openai`` client: how many output tokens/s one API-server process can carry at the most.

    python scripts/dev/frontend_cpu.py --model M [--load-format dummy] [--num-prompts 400] \
        [--prompt-len 64] [--output-len 128] [--py-spy stacks.txt] [-- serve.py flags]

It starts ``scripts/serve.py`` (its engine core is a child process with its own CPU time, not counted),
waits for ``/health``, runs ``scripts/bench_serving.py`` at rate inf on synthetic requests (random prompt
token ids below the model's vocabulary size, fixed output lengths, ``ignore_eos``), and reads the server
process's own user + system CPU time from ``/proc`` before and after (with ``--api-server-count N``
after ``--``: the sum over the N API-server processes). ``1e6 / (us per token)`` is the
output rate at which that process would be busy all the time: if it is near the engine's offline tokens/s,
the front end is the limit at rate inf and a second API-server process (vLLM's ``--api-server-count``) is
the remedy. CPU time, unlike wall time, does not depend on what else the machine runs (Linux only).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` itself (``/proc/PID/stat`` fields 14 and 15)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def api_server_pids(pid: int) -> list[int]:
    """``pid`` and its children that run ``serve.py`` (the API-server processes of ``--api-server-count``;
    engine cores, ``python -m jaxkv.engine.core``, are left out)."""
    out = [pid]
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if ppid == pid and b"serve.py" in cmd:
            out.append(int(d.name))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--vocab-size", type=int, default=None, help="prompt ids below this (default: the model's)")
    p.add_argument("--num-prompts", type=int, default=400)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--client-processes", type=int, default=2)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--health-timeout", type=float, default=600)
    p.add_argument("--py-spy", default=None, metavar="FILE",
                   help="also sample the API-server process with py-spy during the load (collapsed stacks to FILE; "
                        "--gil: only samples that hold the GIL, so its waits are left out)")
    p.add_argument("serve_args", nargs="*", help="more scripts/serve.py flags (after --)")
    args = p.parse_args(argv)
    vocab = args.vocab_size
    if vocab is None:
        sys.path.insert(0, str(ROOT))
        from models import registry
        from models.registry import resolve_model
        vocab = registry.load_config(resolve_model(args.model)).vocab_size
    rng = random.Random(0)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="frontend_cpu."))
    requests = [[[rng.randrange(3, vocab - 3) for _ in range(args.prompt_len)], args.output_len]
                for _ in range(args.num_prompts)]
    (tmp / "requests.json").write_text(json.dumps(requests))
    sys.path.insert(0, str(ROOT / "scripts"))
    from soak_server import start_server, stop_server  # start: wait for /health 200; stop: SIGTERM, drained

    server, base, _ = start_server(["--model", args.model, "--load-format", args.load_format, "--port",
                                    str(args.port), *args.serve_args], str(tmp / "server.log"),
                                   args.health_timeout, dict(os.environ))
    try:
        spy = None
        if args.py_spy:
            spy = subprocess.Popen(["py-spy", "record", "-p", str(api_server_pids(server.pid)[-1]), "-o", args.py_spy,
                                    "--format", "raw", "-r", "200", "--gil"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        pids = api_server_pids(server.pid)
        before = sum(cpu_seconds(p) for p in pids)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_serving.py"), "--base-url",
                        base, "--requests", str(tmp / "requests.json"),
                        "--num-prompts", str(args.num_prompts), "--request-rate", "inf",
                        "--client-processes", str(args.client_processes), "--result-json",
                        str(tmp / "result.json")], check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        used = sum(cpu_seconds(p) for p in pids) - before
        if spy is not None:
            spy.send_signal(2)
            spy.wait(timeout=60)
    finally:
        stop_server(server, 30)
    run = json.loads((tmp / "result.json").read_text())["runs"][0]
    tokens, done = run["total_output_tokens"], run["completed"]
    print(f"{done}/{args.num_prompts} requests, {tokens} output tokens in {wall:.1f} s "
          f"({tokens / wall:,.0f} tok/s on this machine)")
    print(f"API-server process(es) {pids}: {used:.2f} CPU s = {1e6 * used / tokens:.1f} us per output token, "
          f"{1e3 * used / max(done, 1):.2f} ms per request")
    n = max(len(pids) - 1, 1)  # with --api-server-count N the first pid is the supervisor
    print(f"{n} API-server process(es) would be busy all the time at ~{n * tokens / used:,.0f} output tok/s "
          f"(the load spread evenly; at this load's tokens per chunk and request length)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
