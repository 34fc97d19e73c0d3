"""The kernels of the core, one module per family, each Triton kernel beside its plain-torch twin.

rotary: q/k norm, rotary and the KV store (plain torch); decode: paged decode; prefill: varlen
prefill; sampling: the sampler's draw; common: whether Triton runs. layers picks what to call. On
CUDA the Triton kernels run, on CPU the references, unless TRITON_INTERPRET=1 at import built them
with Triton's interpreter (CI). Invariant: no kernel syncs with the host, so decode can be a graph.
"""
# ruff: noqa: F401  (this module only re-exports the public names of its submodules)

from .common import INTERPRETED, use_triton
from .decode import paged_decode
from .prefill import gather_kv, prefill_attention, prefill_attention_ref
from .rotary import rms_norm_ref, rotary_ref, store_kv, to_cache_dtype
from .sampling import sample
