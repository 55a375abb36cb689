"""Fused GPU kernels (Triton) for the fast decode/verify path, each with a torch reference.

Every op here has two implementations with one signature: a Triton kernel, used for CUDA
tensors (or for CPU tensors when the Triton interpreter is on, which the CPU test suite
uses to run the kernels' own code), and a plain-torch reference, the definition the kernels
are tested against. On the CPU the step's ops run native row-invariant kernels where those
apply (`cpu_rows`: compiled C, each tested against its reference), the reference elsewhere.

Batch invariance: each kernel's launch configuration depends only on the weight shapes
(and, for attention, on the cache length), never on how many rows share a launch, and no
kernel reduces across rows; so a row's result does not depend on the other rows of its
window or batch (DESIGN §11).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


def interpreting() -> bool:
    """The Triton interpreter is on (TRITON_INTERPRET=1): kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def triton_available() -> bool:
    # (cached: every op asks, and a module search is not free on the CPU path)
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op on `x` runs its Triton kernel (else the torch reference)."""
    if x.is_cuda:
        return triton_available()
    return x.device.type == "cpu" and interpreting() and triton_available()


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def paged_rows(block_tables: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
               block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, offsets) where the KV rows of (slot, position) pairs live in a paged cache:
    row positions % block_size of block block_tables[slots, positions // block_size]."""
    blocks = block_tables[slots, torch.div(positions, block_size, rounding_mode="floor")].long()
    return blocks, positions % block_size


def tl_dtype(dtype: torch.dtype):
    """The triton.language dtype of a torch floating dtype (for constexpr arguments)."""
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def pdl_supported(device: torch.device | str) -> bool:
    """Programmatic dependent launch (compute capability 9.0+): a kernel's programs start while
    its predecessor finishes and wait for it in-kernel, hiding the launch gap (DESIGN §11)."""
    device = torch.device(device)
    return device.type == "cuda" and triton_available() and torch.cuda.get_device_capability(device)[0] >= 9


# Under PDL a kernel's programs start while the kernel before finishes. What that kernel does not
# write (weights, the host's inputs, results of kernels further back, which had finished before
# it passed its own wait) the small per-row kernels read before their wait, so those loads overlap it.
EARLY_READS = True


def early_reads() -> bool:
    """Whether the per-row kernels read their inputs that the kernel before does not write before
    waiting for it (a module switch, read at launch: bench/config_sweep.py patches it)."""
    return EARLY_READS


def launch_options(pdl: bool) -> dict[str, bool]:
    """Extra launch arguments of a kernel that takes the PDL constexpr (the interpreter knows none)."""
    return {"launch_pdl": True} if pdl else {}
