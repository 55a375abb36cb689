"""How many KV positions the verifier's pool holds: a setting, or sized from free memory.

On a GPU the pool takes what leaves (1 - fraction) of the device's memory free once the
weights are loaded (vLLM's gpu_memory_utilization, read as "this process and the pool may
fill the device up to this share", other processes' memory counted as used); on the CPU it
takes that share of the RAM available. Never more than max_sessions x max_context positions
(in whole blocks): more could never be used.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from kernels.fused import cdiv


@dataclass(frozen=True)
class KVPlan:
    num_tokens: int  # positions in the pool, all sessions together
    block_size: int  # positions per block
    bytes_per_token: int
    source: str  # how num_tokens was chosen (for the start-up log)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"kv_block_size {self.block_size} must be >= 1")
        if self.num_tokens < self.block_size:
            raise ValueError(f"the KV pool holds {self.num_tokens} positions, less than one block of {self.block_size}")

    @property
    def num_blocks(self) -> int:
        return self.num_tokens // self.block_size

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token

    def describe(self) -> str:
        return (f"KV pool: {self.num_blocks} blocks x {self.block_size} positions "
                f"({self.bytes / 2**30:.2f} GiB, {self.source})")


def available_ram() -> int:
    """Bytes of RAM available to new allocations (MemAvailable; free pages where it is missing)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_kv(*, requested_tokens: int, memory_fraction: float, block_size: int, bytes_per_token: int,
            device: torch.device, max_sessions: int, max_context: int) -> KVPlan:
    """The pool for these settings: `requested_tokens` if set, else sized from memory."""
    if not (math.isfinite(memory_fraction) and 0 < memory_fraction <= 1):
        raise ValueError(f"kv_memory_fraction {memory_fraction!r} must lie in (0, 1]")
    ceiling = max_sessions * cdiv(max_context, block_size) * block_size  # (a request holds whole blocks)
    if requested_tokens:
        return KVPlan(requested_tokens, block_size, bytes_per_token, "kv_cache_tokens")
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - memory_fraction) * total
        where = f"{memory_fraction:g} of the GPU's {total / 2**30:.0f} GiB, {free / 2**30:.1f} GiB free"
    else:
        budget = memory_fraction * available_ram()
        where = f"{memory_fraction:g} of the available RAM"
    tokens = int(max(budget, 0) // bytes_per_token)
    if tokens >= ceiling:
        return KVPlan(ceiling, block_size, bytes_per_token, f"max_sessions x max_context; memory allows more: {where}")
    if tokens < block_size:
        raise ValueError(f"no memory left for the KV pool ({where}): lower the model's size, raise "
                         "kv_memory_fraction or set kv_cache_tokens")
    return KVPlan(tokens // block_size * block_size, block_size, bytes_per_token, where)
