"""Random weights made on the device (vLLM's ``--load-format dummy``): a model of real size without a checkpoint.

The whole initialisation is one jitted program whose outputs are the parameters, ``out_shardings`` placing
each where :func:`models.parallel.partition_spec` puts it (one device, or sharded over a ``(dp, tp)`` mesh):
no host-side random numbers, no host copy, no transfer. The values are the modules' own initialisers
(``nnx.Linear``: LeCun normal; ``nnx.Embed``: variance scaling; norms: ones) drawn by ``jax.random`` from
``seed``; JAX's partitionable threefry makes them independent of the sharding, so the same seed gives the
same weights on one device and on any mesh (tp=2 greedy text equals tp=1's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.decoder import DecoderForCausalLM
from models.decoder_config import DecoderConfig
from models.parallel import param_shardings


def dummy_model(config: DecoderConfig, *, dtype=jnp.bfloat16, seed: int = 0, mesh=None,
                cls=DecoderForCausalLM) -> DecoderForCausalLM:
    """A ``cls`` of ``config`` with random weights created on the device(s).

    Args:
        config: the model's config (any size: built-in, from a ``config.json``, ...).
        dtype: the model dtype (norm weights stay float32).
        seed: the ``nnx.Rngs`` seed.
        mesh: a ``(dp, tp)`` mesh to create the parameters in their shards, or ``None`` (the default device).
        cls: the model class.

    Raises:
        ValueError: the heads / intermediate size do not split over the mesh's ``tp`` (names the field).
    """
    dtype = jnp.dtype(dtype)

    def make():
        return nnx.split(cls(config, dtype=dtype, rngs=nnx.Rngs(seed)))

    graphdef, abstract = nnx.eval_shape(make)
    if mesh is None:
        # one device: uncommitted arrays on the default device, as every other single-device path makes them.
        # Committed (SingleDeviceSharding) parameters made the engine's step programs carry a device
        # sharding, and on an H200 each step's dispatch then took 130 ms of host time instead of 1 ms
        # (docs/perf-notes.md, session 15).
        state = jax.jit(lambda: make()[1])()
    else:
        state = jax.jit(lambda: make()[1], out_shardings=param_shardings(abstract, config, mesh))()
    return nnx.merge(graphdef, state)
