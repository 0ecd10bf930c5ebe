"""The engine loop (vLLM ``vllm/v1/engine/``).

* ``llm_engine`` -- :class:`~jaxkv.engine.llm_engine.LLMEngine`: add requests, abort them, step, read outputs;
  the scheduler (:mod:`jaxkv.core`) and the model runner (:mod:`jaxkv.worker`) in one process.
* ``core`` -- the engine core in a process of its own (vLLM ``EngineCoreProc``): a busy loop over ZeroMQ.
* ``core_client`` -- front-end clients of engine-core processes: launch, liveness, shutdown (vLLM
  ``SyncMPClient`` / ``AsyncMPClient``); ``load_balancer`` picks a data-parallel rank.
* ``protocol`` -- the messages between them and their msgpack codec.

Front-end processes import ``core_client`` and ``protocol`` only, which import no JAX.
"""
