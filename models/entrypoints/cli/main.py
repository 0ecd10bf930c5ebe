"""``jaxkv``: the installed command (``[project.scripts]``; vLLM's ``vllm`` command).

    jaxkv serve [MODEL] [flags]              the OpenAI-compatible server (models.entrypoints.openai.server)
    jaxkv generate --prompt TEXT [flags]     offline generation, printed (models.entrypoints.cli.generate)
    jaxkv bench throughput [flags]           offline throughput on ShareGPT (models.benchmarks.throughput)
    jaxkv bench serving [flags]              a running server under load (models.benchmarks.serving)

``jaxkv SUBCOMMAND --help`` lists a subcommand's flags; the engine's are the same everywhere
(:meth:`models.entrypoints.engine_args.EngineArgs.add_cli_args`). As with ``vllm serve``, the model may be
given as the first argument of ``serve``, ``generate`` and ``bench throughput`` instead of ``--model``.
Each subcommand's module is imported only when it runs, so ``jaxkv serve`` starts its engine-core processes
before the HTTP stack or JAX is imported.
"""

from __future__ import annotations

import importlib
import sys

# subcommand (words) -> module whose main(argv) runs it, and whether it takes the model as its first argument
SUBCOMMANDS = {
    ("serve",): ("models.entrypoints.openai.server", True),
    ("generate",): ("models.entrypoints.cli.generate", True),
    ("bench", "throughput"): ("models.benchmarks.throughput", True),
    ("bench", "serving"): ("models.benchmarks.serving", False),
}


def _usage() -> str:
    names = ", ".join(" ".join(words) for words in SUBCOMMANDS)
    return f"usage: jaxkv {{{names}}} [--help] ...\n\n{__doc__}"


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand named by ``argv``'s first words with the rest of ``argv``.

    Returns the subcommand's exit code; an unknown subcommand prints the usage and returns 2.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    for words, (module, model_first) in SUBCOMMANDS.items():
        if tuple(argv[:len(words)]) == words:
            rest = argv[len(words):]
            if model_first and rest and not rest[0].startswith("-"):
                rest = ["--model", *rest]  # `jaxkv serve MODEL ...` as `vllm serve MODEL ...`
            sys.argv[0] = f"jaxkv {' '.join(words)}"
            return importlib.import_module(module).main(rest) or 0
    print(f"jaxkv: unknown subcommand {' '.join(argv[:2])!r}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
