"""GPU kernels, one module per family, each Triton kernel beside its plain-torch reference.

rotary: q/k norm, rotary and KV store; decode: paged decode with cascade attention; prefill: varlen
prefill; sampling: the sampler's draw; common: whether Triton runs. layers picks what to call. On
CUDA the Triton kernels run, on CPU the references, unless TRITON_INTERPRET=1 at import built them
with Triton's interpreter (CI). Invariant: no kernel syncs with the host, so decode can be a graph.
"""
# ruff: noqa: F401  (this module only re-exports the public names of its submodules)

from .common import INTERPRETED, use_triton
from .decode import paged_decode, paged_decode_ref
from .prefill import context_slots, gather_kv, prefill_attention, prefill_attention_ref
from .rotary import (
    rms_norm_ref,
    rotary_and_store,
    rotary_and_store_ref,
    rotary_ref,
    store_kvcache_ref,
)
from .sampling import sample, sample_ref
