"""A layer chain in one persistent CUDA kernel: issue 39's second probe (DESIGN §11).

The Triton probe (kernels.fused.persistent) said a grid barrier in Triton costs more than a kernel
boundary and a stage streams at a tenth of a dedicated kernel's rate. This one is CUDA C++
(persistent_cuda.cu, compiled at first use by NVRTC through torch): one resident block a
multiprocessor, a producer warp streaming each stage's weight tiles into a ring of shared-memory
slots with bulk copies while eight consumer warps multiply, and stage boundaries as counters in
global memory. The chain is a decode layer's products without attention's own kernels:

    qkv [Q, H] -> o [H, Q] -> norm -> router [E, H] -> top-8 -> gate/up [E, 2I, H] -> SiLU·up
    -> down [E, H, I], combined by route weight in ascending expert order -> norm -> next layer

(`reference` is the same function in torch, with the kernel's roundings to bf16.)

Invariants: every sum in an order fixed by the weights' shapes alone, so a row's bits do not
depend on the other rows or the grid (row invariance, DESIGN §11); the grid is one block a
multiprocessor and every block must be resident at once (the counters are a grid barrier).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

SOURCE = Path(__file__).with_name("persistent_cuda.cu")
# persistent_cuda.cu's constants
MAX_ROWS, MAX_SLOTS, TOP_K, NUM_EXPERTS, STAGES, PAD, KT_MAX = 8, 8, 8, 128, 5, 8, 2048
SLOT_BYTES = 8 * (KT_MAX + PAD) * 2
THREADS = 288  # 8 consumer warps and the producer
STATIC_SMEM = 10240  # the kernels' static shared memory (ptxas -v: 9856), with a margin
EPS = 1e-6
WIDTHS = (256, 512, 1024, 2048, 4096)  # K widths a stage input may have


@dataclass(frozen=True)
class ChainLayer:
    qkv: Tensor  # [Q, H]
    o: Tensor  # [H, Q]
    router: Tensor  # [E, H]
    gate_up: Tensor  # [E, 2I, H]: gate rows, then up rows
    down: Tensor  # [E, H, I]

    def check(self, index: int) -> None:
        q, h = self.qkv.shape
        e, two_i, _ = self.gate_up.shape
        shapes = {"o": (h, q), "router": (NUM_EXPERTS, h), "gate_up": (NUM_EXPERTS, two_i, h),
                  "down": (NUM_EXPERTS, h, two_i // 2)}
        for name, shape in shapes.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape:
                raise ValueError(f"layers[{index}].{name}: shape {tuple(t.shape)}, expected {shape}")
        for name in ("qkv", "o", "router", "gate_up", "down"):
            t = getattr(self, name)
            if t.dtype != torch.bfloat16 or not t.is_contiguous():
                raise ValueError(f"layers[{index}].{name}: must be contiguous bf16")
        inter = two_i // 2
        if h not in WIDTHS or q not in WIDTHS or inter % 16 or inter > KT_MAX // 2 - PAD:
            raise ValueError(f"layers[{index}]: widths H={h}, Q={q} must be among {WIDTHS}, I={inter} a multiple "
                             f"of 16 up to {KT_MAX // 2 - PAD} (a down tile's 16 rows fill a slot)")


@functools.cache
def kernel(name: str):
    """persistent_cuda.cu's kernel `name` (layer_chain_mma, layer_chain_fma, stream_ring), compiled
    by NVRTC for this GPU, allowed all the dynamic shared memory a block may have (a launch may
    take less: the limit is the function's, shared by every LayerChain)."""
    compiled = torch.cuda._compile_kernel(SOURCE.read_text(), name)
    compiled.set_shared_memory_config(_smem_limit() - STATIC_SMEM)
    return compiled


def _smem_limit() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).shared_memory_per_block_optin


def _xbuf_bytes(rows: int, inter: int, q_width: int) -> int:
    return rows * max((q_width + PAD) * 2, TOP_K * (inter + PAD) * 2)


def most_slots(xbuf_bytes: int) -> int:
    return min(MAX_SLOTS, (_smem_limit() - STATIC_SMEM - xbuf_bytes) // SLOT_BYTES)


class LayerChain:
    """The chain on fixed buffers for `rows` rows; run(x) launches it on the current stream
    (capturable in a CUDA graph) and returns the last layer's combine, before its norm."""

    def __init__(self, layers: list[ChainLayer], rows: int, slots: int | None = None, use_mma: bool = True,
                 stream_only: bool = False, l2_prefetch: bool = False):
        if not layers:
            raise ValueError("layers: at least one")
        if not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"rows = {rows} must lie in [1, {MAX_ROWS}]")
        for i, layer in enumerate(layers):
            layer.check(i)
        first = layers[0]
        self.q_width, self.hidden = first.qkv.shape
        self.inter = first.down.shape[2]
        device = first.qkv.device
        xbuf = _xbuf_bytes(rows, self.inter, self.q_width)
        most = most_slots(xbuf)
        self.slots = most if slots is None else slots
        if not 1 <= self.slots <= most:
            raise ValueError(f"slots = {slots} must lie in [1, {most}] (shared memory)")
        self.layers, self.rows = layers, rows

        def pointers(name):
            return torch.tensor([getattr(layer, name).data_ptr() for layer in layers], dtype=torch.int64, device=device)

        self.pointers = [pointers(name) for name in ("qkv", "o", "router", "gate_up", "down")]
        bf16 = dict(dtype=torch.bfloat16, device=device)
        self.x = torch.zeros(rows, self.hidden, **bf16)
        self.qkv_out = torch.zeros(rows, self.q_width, **bf16)
        self.o_out = torch.zeros(rows, self.hidden, **bf16)
        self.logits = torch.zeros(rows, NUM_EXPERTS, **bf16)
        self.act = torch.zeros(rows * TOP_K, self.inter, **bf16)
        self.out = torch.zeros(rows, self.hidden, **bf16)
        self.counters = torch.zeros(len(layers) * STAGES + 1, dtype=torch.int32, device=device)
        self.smem = self.slots * SLOT_BYTES + xbuf
        # bit 0: the weights streamed, no products (outputs zero); bit 1: the next layer's attention
        # weights prefetched into L2 while a layer's routes are made
        self.mode = int(stream_only) | 2 * int(l2_prefetch)
        self.kernel = kernel("layer_chain_mma" if use_mma else "layer_chain_fma")
        self.grid = torch.cuda.get_device_properties(device).multi_processor_count

    def run(self, x: Tensor) -> Tensor:
        self.x.copy_(x)
        self.kernel(grid=(self.grid, 1, 1), block=(THREADS, 1, 1),
                    args=[*self.pointers, self.x, self.qkv_out, self.o_out, self.logits, self.act, self.out,
                          self.counters, len(self.layers), self.rows, self.hidden, self.q_width, self.inter,
                          self.slots, self.mode],
                    shared_mem=self.smem)
        return self.out


def stream_ring(total_bytes: int, copy_bytes: int, copies: int, slots: int):
    """A launcher of stream_ring (timed by bench/persistent_cuda.py): the grid streams about
    `total_bytes` in tiles of `copies` bulk copies of `copy_bytes` through `slots` ring slots, no
    products — what the ring alone moves. Returns (launch, bytes one launch streams)."""
    if copies * (copy_bytes + PAD * 2) > SLOT_BYTES or copy_bytes % 16:
        raise ValueError(f"copies × copy_bytes = {copies} × {copy_bytes} does not fit a {SLOT_BYTES} B slot in 16 B units")
    grid = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    tile = copy_bytes * copies
    per_block = total_bytes // grid // tile * tile
    src = torch.empty(per_block * grid, dtype=torch.uint8, device="cuda")
    sink = torch.empty(grid, dtype=torch.int32, device="cuda")
    run = kernel("stream_ring")

    def launch() -> None:
        run(grid=(grid, 1, 1), block=(THREADS, 1, 1), args=[src, per_block, copy_bytes, copies, slots, sink],
            shared_mem=slots * SLOT_BYTES)
    return launch, per_block * grid


def barrier_chain(stages: int):
    """A launcher of barrier_chain (timed by bench/persistent_cuda.py): `stages` stage boundaries in
    one launch — the chain's own barrier and a word's round trip through it, nothing else."""
    grid = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    counters = torch.zeros(stages + 1, dtype=torch.int32, device="cuda")
    words = torch.zeros(stages, grid, dtype=torch.int32, device="cuda")
    run = kernel("barrier_chain")

    def launch() -> None:
        run(grid=(grid, 1, 1), block=(256, 1, 1), args=[counters, words, stages])
    return launch


def rms(h: Tensor) -> Tensor:
    """RMS norm with unit weights, in float32, rounded to bf16 (as the kernel's stage inputs)."""
    h = h.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16).float()


def _bf(t: Tensor) -> Tensor:
    return t.to(torch.bfloat16).float()


def reference(layers: list[ChainLayer], x: Tensor) -> tuple[Tensor, list[Tensor]]:
    """The chain in torch (float32 sums, the kernel's roundings); returns the last combine and
    each layer's routes ([rows, top_k] expert ids, descending logit)."""
    h = x.float()
    routes = []
    for index, layer in enumerate(layers):
        inp = h if index == 0 else rms(h)
        q = _bf(inp @ layer.qkv.float().T)
        xin = rms(_bf(q @ layer.o.float().T))
        logits = _bf(xin @ layer.router.float().T)  # [rows, E]
        order = torch.sort(logits, dim=-1, descending=True, stable=True)  # ties to the lower expert
        top, ids = order.values[:, :TOP_K], order.indices[:, :TOP_K]
        weights = torch.softmax(top, -1)
        routes.append(ids)
        inter = layer.down.shape[2]
        combine = torch.zeros_like(h)
        for r in range(h.shape[0]):
            for k in torch.argsort(ids[r]).tolist():  # ascending expert id: the kernel's order
                e = int(ids[r, k])
                gu = layer.gate_up[e].float()
                g, up = _bf(gu[:inter] @ xin[r]), _bf(gu[inter:] @ xin[r])
                act = _bf(_bf(F.silu(g)) * up)
                combine[r] += weights[r, k] * _bf(layer.down[e].float() @ act)
        h = _bf(combine)
    return h, routes
