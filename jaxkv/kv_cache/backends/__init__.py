"""Backend layouts the engine allocates: the protocol and its helpers (``base``), the Pallas kernels' layout
(``pallas``). vLLM's other backends' layouts and the by-name registry are in
:mod:`jaxkv.vllm_parity.backends`."""
