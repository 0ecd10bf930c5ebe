"""The ``jaxkv`` command (vLLM: ``vllm/entrypoints/cli/``): ``jaxkv serve``, ``jaxkv generate``,
``jaxkv bench throughput``, ``jaxkv bench serving``. :mod:`models.entrypoints.cli.main` dispatches;
each subcommand's flags are its module's."""
