"""GPU kernels, each beside its plain-torch reference, one module per family: rotary + KV store
(rotary), paged decode with cascade attention (decode), varlen prefill (prefill) and sampling
(sampling); common says whether the Triton kernels run at all.

Owns the math on the paged KV cache and the sampler's draw, nothing else: layers.Attention and
layers.Sampler pick what to call, model_runner builds the batch tensors. On CUDA the Triton kernels
run; on CPU the references run, unless TRITON_INTERPRET=1 at import built the kernels with Triton's
interpreter (CI). Invariant: no kernel syncs with the host, so a decode step can be a CUDA graph.
"""
# ruff: noqa: F401  (this module only re-exports the public names of its submodules)

from .common import INTERPRETED, use_triton
from .decode import default_num_splits, paged_decode, paged_decode_ref
from .prefill import context_slots, gather_kv, prefill_attention, prefill_attention_ref
from .rotary import (
    rms_norm_ref,
    rotary_and_store,
    rotary_and_store_ref,
    rotary_ref,
    store_kvcache_ref,
)
from .sampling import sample, sample_ref
