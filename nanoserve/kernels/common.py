"""What every kernel module shares: whether the Triton kernels run (on the GPU, or interpreted).

Owns no kernel. Invariant: INTERPRETED is the setting triton.jit reads when it builds a kernel
(TRITON_INTERPRET=1 at import: the interpreter, which runs the kernels on CPU tensors for CI), read
at import as every kernel here is built. Called by decode, which picks between a kernel and
its torch reference with use_triton, and by extensions.
"""

import torch
import triton

INTERPRETED = triton.knobs.runtime.interpret


def use_triton(t: torch.Tensor) -> bool:
    """True where the Triton kernels run on t: on a GPU, or on the CPU under the interpreter."""
    return t.is_cuda or INTERPRETED
