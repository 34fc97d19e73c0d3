"""What every kernel module shares: whether the Triton kernels run (on the GPU, or interpreted).

Owns no kernel. Invariant: INTERPRETED is read once, at import, by building a kernel the way every
kernel of the package is built, so it agrees with the choice triton.jit made (TRITON_INTERPRET=1 at
import: the interpreter, which runs the kernels on CPU tensors for CI). Called by decode and
sampling, which pick between a kernel and its torch reference with use_triton, and by extensions.
"""

import torch
import triton


@triton.jit
def _probe():  # never launched: triton.jit builds it as it builds every kernel here
    pass


INTERPRETED = not isinstance(_probe, triton.runtime.jit.JITFunction)


def use_triton(t: torch.Tensor) -> bool:
    """True where the Triton kernels run on t: on a GPU, or on the CPU under the interpreter."""
    return t.is_cuda or INTERPRETED
