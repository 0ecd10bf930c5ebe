import dataclasses, numpy as np, sys
sys.path.insert(0, ".")
import jax
from tests.pallas_kernels import fuzz
from tests.pallas_kernels.test_paged_attention_mgpu import _cls
from pallas_kernels.paged_attention_mgpu import paged_attention_mgpu
interp = jax.default_backend() != "gpu"
for fp8 in (True, False):
    for e in (0, 6, 10, 13, 15):
        for persistent in (True, False):
            cls = _cls(head=128, block=16, group=4, fp8=fp8, width=12)
            case = fuzz.make_case(np.random.default_rng(8), cls, [(150, 1), (33, 1)])
            case = dataclasses.replace(case, q=case.q * 2.0 ** e)
            arrays, kwargs = case.kernel_args()
            out = paged_attention_mgpu(*arrays, **kwargs, interpret=interp, persistent=persistent)
            print(f"fp8={fp8} q*2^{e} max|q|={np.abs(case.q).max():.0f} persistent={persistent} err={fuzz.error(out, case):.3g}", flush=True)
