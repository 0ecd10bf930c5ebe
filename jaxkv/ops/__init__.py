"""Model ops whose kernels live in :mod:`pallas_kernels`, each beside its XLA form (``models`` reaches kernels only
through ``jaxkv``): the fused SwiGLU + per-token fp8 quantization (:mod:`jaxkv.ops.activation`)."""
