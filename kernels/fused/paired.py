"""bfloat16 weights in the paired layout, read by the CPU's float32 step (DESIGN §11).

A bfloat16 checkpoint served with float32 activations on the CPU (the default there) holds
weights whose values are bfloat16 values: float32 doubles their bytes and adds no bits. The
step's products and experts stream their weights from memory, so the native kernels
(`_cpu_rows.c`, type PAIRED) read them as bfloat16 and convert in registers: the same float32
values, summed in the same order, hence the same bits as the float32 weights, from half the
bytes. The layout serves that conversion: a row's first n16 = n // 16 * 16 values in chunks of
16, each chunk's values j and j + 8 side by side, so a 32-byte load splits into the chunk's two
sets of eight lanes by a shift and a mask; the last n - n16 values in order.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK = 16


def pair_bf16(weight: Tensor) -> Tensor | None:  # [..., n] float32
    """The weight as bfloat16 in the paired layout [..., n] (contiguous), or None where it is not
    float32 on the CPU or some value is not exactly a bfloat16 (then pairing would change it)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() < 1:
        return None
    halves = weight.to(torch.bfloat16)
    if not torch.equal(halves.float(), weight):  # (a NaN never compares equal: left as it is)
        return None
    n = weight.shape[-1]
    n16 = n // CHUNK * CHUNK
    lead = weight.shape[:-1]
    head = halves[..., :n16].reshape(*lead, n16 // CHUNK, 2, CHUNK // 2).transpose(-1, -2).reshape(*lead, n16)
    return torch.cat((head, halves[..., n16:]), dim=-1).contiguous()


def unpair(paired: Tensor) -> Tensor:  # [..., n] bfloat16, paired
    """The float32 weight a paired tensor holds (pair_bf16's inverse): the tests' reference."""
    n = paired.shape[-1]
    n16 = n // CHUNK * CHUNK
    lead = paired.shape[:-1]
    head = paired[..., :n16].reshape(*lead, n16 // CHUNK, CHUNK // 2, 2).transpose(-1, -2).reshape(*lead, n16)
    return torch.cat((head, paired[..., n16:]), dim=-1).float()
