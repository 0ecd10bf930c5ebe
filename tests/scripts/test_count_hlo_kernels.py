"""scripts/dev/count_hlo_kernels.py on a hand-written optimized-HLO module and on a real XLA dump."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tests.conftest import load_script

HLO = """HloModule jit_step

%fused_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %e = f32[4]{0} exponential(%p)
  ROOT %n = f32[4]{0} negate(%e)
}

%region_add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %loop_exp_fusion.2 = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation
  %k = f32[4]{0} custom-call(%loop_exp_fusion.2), custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":"paged_attention_bh16"}
  %c = f32[4]{0} copy(%k)
  %r = f32[] reduce(%c, %i), dimensions={0}, to_apply=%region_add
  ROOT %o = (s32[], f32[4]{0}) tuple(%i, %c)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[4]{0}) tuple(%z, %x)
  %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body
  %input_reduce_fusion_3 = f32[4]{0} fusion(%x), kind=kInput, calls=%fused_computation
  ROOT %g = f32[4]{0} get-tuple-element(%w), index=1
}
"""


def test_counts_launching_instructions_per_computation():
    mod = load_script("count_hlo_kernels")
    comps = mod.kernels_by_computation(HLO)
    assert "fused_computation" not in comps and "region_add" not in comps  # run inside kernels
    assert comps["body"] == {"fusion loop_exp_fusion": 1, "copy": 1, "reduce": 1,
                             "custom-call __gpu$xla.gpu.triton paged_attention_bh16": 1}
    assert comps["main"] == {"fusion input_reduce_fusion": 1}  # the while launches nothing itself
    assert sum(comps["cond"].values()) == 0


def test_reads_a_real_dump(tmp_path, monkeypatch):
    """XLA's own optimized HLO of a small jitted function: every computation parses, and the entry has
    at least one kernel."""
    text = jax.jit(lambda x: jnp.sin(x).sum() * 2).lower(jnp.ones(8)).compile().as_text()
    comps = load_script("count_hlo_kernels").kernels_by_computation(text)
    assert comps and sum(sum(c.values()) for c in comps.values()) >= 1
