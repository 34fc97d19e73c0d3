"""What every kernel module shares: whether the Triton kernels run, and the GPU's SM count.

Owns no kernel. Invariant: INTERPRETED is read once, at import, by building a kernel the way every
kernel of the package is built, so it agrees with the choice triton.jit made (TRITON_INTERPRET=1 at
import: the interpreter, which runs the kernels on CPU tensors for CI). Called by rotary, decode and
sampling, which pick between a kernel and its torch reference with use_triton.
"""

import functools

import torch
import triton


@triton.jit
def _probe():  # never launched: triton.jit builds it as it builds every kernel here
    pass


INTERPRETED = not isinstance(_probe, triton.runtime.jit.JITFunction)


def use_triton(t: torch.Tensor) -> bool:
    """True where the Triton kernels run on t: on a GPU, or on the CPU under the interpreter."""
    return t.is_cuda or INTERPRETED


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the device: the split heuristics fill them with programs."""
    if device.type != "cuda":
        return 8  # the interpreter on CPU: any small number keeps the split logic exercised
    return torch.cuda.get_device_properties(device).multi_processor_count
