"""Fused MoE for small token counts: each selected expert's weights are read once.

Three kernels: gate_up (x @ [gate; up]^T, then silu(gate) * up), down (act @ down^T, one
float32 row per route), and combine (the routes' weighted sum in rank order, plus the
residual, plus the next RMSNorm, or with `centred` Qwen3-Next's (1 + w) one). Routes of the same expert are grouped inside the
kernels (no host sort, no sync): the program of a route that opens a group of up to
BLOCK_M routes of its expert loads that expert's weight tile once and multiplies it with
all of them; the other routes' programs exit at once. With many routes the groups come from a
table one small kernel builds first (each program then reads its own entry), else each program
finds its group by comparing its route with all of them. Every route's row is computed the
same way whatever else shares the launch (row invariance).

Weights use the ExpertStore layout: gate_up [E, 2*I, H] (gate rows, then up rows), down
[E, H, I].
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.fused import cdiv, cpu_rows, early_reads, launch_options, next_power_of_2, use_triton
from kernels.fused.fp8 import Fp8Weight
from kernels.fused import linear as linear_module
from kernels.fused.linear import Weight, dense, pipeline_stages, rowwise_linear
from kernels.fused.norm import add_rmsnorm_reference

BLOCK_M = 16  # routes of one expert per program (tl.dot's smallest M)
# From this many routes on, the expert kernels read their groups from a table built once per
# launch (route_table_kernel) instead of each program comparing its route with every route,
# which grows as routes² (H200, 30B shapes: a 64-row step 23.3 -> 18.3 ms, 40 rows 0.89x, 8-32 rows
# 0.99x; one row 1.02x, its extra launch).
TABLE_MIN_ROUTES = 128
TABLE_CHUNK = 16  # routes per program of the table kernel
MAX_FUSED_TOKENS = 64  # above this, the grouped (prefill) path is used
# The down kernel launches as a dependent of gate_up (DOWN_PDL) and its programs read their routes
# and first weight tile before waiting (DOWN_PRELOAD), while gate_up finishes. H200, whole step:
# both 0.987-0.998 of a plain launch; the dependent launch alone 0.99-1.007, the early tile alone
# 1.011-1.014 (docs/PERFORMANCE.md, session 15).
DOWN_PDL = True
DOWN_PRELOAD = True
COMBINE_WARPS = 8  # the combine kernel's, per row (H200: 8 and 16 beat 4 and 2 by ~3% of the step)


def moe_config(num_out: int, num_in: int, element_size: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an expert matrix [num_out, num_in]: shape only.

    Measured on the H200 (bench/config_sweep.py): BN 64 for the down matrix (more outputs than
    inputs), 32 for gate_up; BK 128, 4 warps, 4 stages (flat within 1% around them)."""
    block_n = 64 if num_out > num_in else 32
    block_k = min(128, max(16, next_power_of_2(num_in)))
    return block_n, block_k, 4, pipeline_stages(4, (BLOCK_M + 2 * block_n) * block_k * element_size)


def experts_reference(
    x: Tensor,  # [T, H]
    expert_ids: Tensor,  # [T, k]
    gate_up: Weight,  # [E, 2I, H]
    down: Weight,  # [E, H, I]
) -> Tensor:
    """Per-route expert outputs [T*k, H] float32, route r = t*k + rank (zeros where the id is -1).
    FP8 weights: each routed expert's dequantised to x's dtype."""
    num_tokens, top_k = expert_ids.shape
    num_experts = gate_up.shape[0]
    out = torch.zeros((num_tokens * top_k, x.shape[1]), dtype=torch.float32, device=x.device)
    flat = expert_ids.reshape(-1)
    # On the CPU each route's bits are its own whatever else routes to its expert (windows and
    # batches run as one forward there); on a GPU this runs prompt chunks only (cuBLAS).
    product = rowwise_linear if x.device.type == "cpu" else F.linear
    # The routes sorted by expert (id -1 first, not computed), then each expert's routes as one slice.
    order = torch.argsort(flat, stable=True)  # [T*k]
    counts = torch.bincount(flat + 1, minlength=num_experts + 1).tolist()
    rows = x[order // top_k]  # [T*k, H], grouped by expert
    start, outputs = counts[0], []
    for expert, count in enumerate(counts[1:]):
        if count:
            gate, up = product(rows[start : start + count], dense(gate_up[expert], x.dtype)).float().chunk(2, dim=-1)
            act = (F.silu(gate) * up).to(x.dtype)
            outputs.append(product(act, dense(down[expert], x.dtype)).float())
            start += count
    if outputs:
        out[order[counts[0] :]] = torch.cat(outputs)
    return out


def combine_reference(
    route_out: Tensor,  # [T*k, H] float32
    weights: Tensor,  # [T, k] float32
    residual: Tensor,  # [T, H]
    norm_weight: Tensor,  # [H]
    eps: float,
    centred: bool = False,  # the next norm scales by (1 + w) (CenteredRMSNorm)
) -> tuple[Tensor, Tensor]:
    num_tokens, top_k = weights.shape
    mixed = (route_out.view(num_tokens, top_k, -1) * weights.unsqueeze(-1)).sum(dim=1).to(residual.dtype)
    return add_rmsnorm_reference(mixed, residual, norm_weight, eps, centred)


@functools.cache
def _kernels():
    """Triton is imported on first use, so CPU-only installs never need it."""
    from kernels.fused import moe_kernels

    return (moe_kernels.gate_up_kernel, moe_kernels.down_kernel, moe_kernels.combine_kernel, moe_kernels.silu_mul_kernel,
            moe_kernels.route_table_kernel)


def silu_mul(gate_up: Tensor) -> Tensor:  # [R, 2I] (gate columns, then up) -> [R, I]
    """silu(gate) * up per row: one kernel instead of three elementwise passes (prefill's grouped experts)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if not use_triton(gate_up):
        return F.silu(gate) * up
    num_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows:
        block = min(1024, next_power_of_2(inter))
        _kernels()[3][(num_rows, cdiv(inter, block))](gate_up.contiguous(), out, inter, BLOCK=block, num_warps=4)
    return out


def fused_experts(
    x: Tensor,  # [T, H]
    expert_ids: Tensor,  # [T, k] int64
    gate_up: Weight,  # [E, 2I, H] (or block-scaled FP8: kernels.fused.fp8)
    down: Weight,  # [E, H, I]
    *,
    pdl: bool = False,  # launch as programmatic dependents (kernels.fused.pdl_supported)
    zero_dropped: bool = False,
) -> Tensor:
    """Per-route expert outputs [T*k, H] float32 (route r = t*k + rank). A dropped route (id -1)
    is left unwritten here unless zero_dropped (zeroing costs every step a fill; prompt routing
    drops routes through the store's dispatch path, shared.model.moe; a model split over ranks
    drops the routes to other ranks' experts and zeroes them, so the ranks' outputs add up)."""
    fp8 = isinstance(gate_up, Fp8Weight)
    if fp8 != isinstance(down, Fp8Weight):
        raise ValueError("fused_experts: gate_up and down must both be FP8 or neither")
    if not use_triton(x):
        out = cpu_rows.experts(x, expert_ids, gate_up, down)
        return experts_reference(x, expert_ids, gate_up, down) if out is None else out
    num_tokens, top_k = expert_ids.shape
    hidden = x.shape[1]
    inter = down.shape[2]
    num_routes = num_tokens * top_k
    gate_up_q, down_q = (gate_up.q, down.q) if fp8 else (gate_up, down)
    if not (gate_up_q.is_contiguous() and down_q.is_contiguous()):
        raise ValueError("fused_experts: expert weights must be contiguous")
    if fp8 and not (gate_up.kernel_ready() and down.kernel_ready()):
        raise ValueError(f"fused_experts: FP8 experts in blocks of {list(gate_up.block)} are not ones the kernels "
                         f"read (columns a multiple of 16)")
    gate_up_kernel, down_kernel, _, _, table_kernel = _kernels()
    ids = expert_ids.contiguous()
    r_pad = max(16, next_power_of_2(num_routes))
    ieee = x.dtype == torch.float32
    table = num_routes >= TABLE_MIN_ROUTES
    if table:  # the groups, once: routes sorted by expert, and each group's length at its start
        sorted_routes = torch.empty(num_routes, dtype=torch.int32, device=x.device)
        tile_len = torch.empty(num_routes, dtype=torch.int32, device=x.device)
        table_kernel[(cdiv(num_routes, TABLE_CHUNK),)](
            ids, sorted_routes, tile_len, num_routes, R_PAD=r_pad, CHUNK=TABLE_CHUNK, BLOCK_M=BLOCK_M, PDL=pdl,
            num_warps=4, **launch_options(pdl),
        )
    else:
        sorted_routes = tile_len = ids  # (unread)
    act = torch.empty((num_routes, inter), dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = expert_config(gate_up, x.dtype)
    gate_up_kernel[(num_routes, cdiv(inter, block_n))](
        x.contiguous(), ids, sorted_routes, tile_len, gate_up_q, act, num_routes, inter, hidden,
        TOP_K=top_k, R_PAD=r_pad, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, PDL=pdl,
        TABLE=table, **expert_fp8_arguments(gate_up, block_k, x), num_warps=warps, num_stages=stages, **launch_options(pdl),
    )
    out = (torch.zeros if zero_dropped else torch.empty)((num_routes, hidden), dtype=torch.float32, device=x.device)
    block_n, block_k, warps, stages = expert_config(down, x.dtype)
    down_pdl = pdl and DOWN_PDL
    down_kernel[(num_routes, cdiv(hidden, block_n))](
        act, ids, sorted_routes, tile_len, down_q, out, num_routes, inter, hidden,
        R_PAD=r_pad, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, PDL=down_pdl, TABLE=table,
        PRELOAD=DOWN_PRELOAD, **expert_fp8_arguments(down, block_k, x), num_warps=warps, num_stages=stages,
        **launch_options(down_pdl),
    )
    return out


def expert_config(weight: Weight, x_dtype: torch.dtype) -> tuple[int, int, int, int]:
    """moe_config of an expert stack [E, N, K]; FP8: EXPERT_FP8_WIDEN times bf16's K tile, inside
    one block column with EXPERT_FP8_EXACT (linear.py)."""
    num_out, num_in = weight.shape[1:]
    x_bytes = torch.finfo(x_dtype).bits // 8
    if not isinstance(weight, Fp8Weight):
        return moe_config(num_out, num_in, x_bytes)
    block_n, block_k, warps, _ = moe_config(num_out, num_in, 2)
    wanted = min(linear_module.EXPERT_FP8_WIDEN * block_k, max(16, next_power_of_2(num_in)))
    block_k = weight.tile_k(min(wanted, weight.block[1]) if linear_module.EXPERT_FP8_EXACT else wanted)
    return block_n, block_k, warps, pipeline_stages(4, (BLOCK_M * x_bytes + 2 * block_n) * block_k)


def expert_fp8_arguments(weight: Weight, block_k: int, x: Tensor) -> dict:
    """The expert kernels' FP8 arguments: the block scales (experts stride_se apart, block rows
    stride_sn), blocks (SBN × SBK, pieces of SUB columns) and the way (linear.fp8_way); for
    full-precision weights FP8 off and a stand-in pointer, unread."""
    if not isinstance(weight, Fp8Weight):
        return dict(s_ptr=weight, stride_se=0, stride_sn=0, FP8=False, SBN=1, SBK=1, SUB=1,
                    **linear_module.fp8_way(False, x))
    sbn, sbk = weight.block
    return dict(s_ptr=weight.scale, stride_se=weight.scale.stride(0), stride_sn=weight.scale.stride(1), FP8=True,
                SBN=sbn, SBK=sbk, SUB=min(block_k, sbk), **linear_module.fp8_way(linear_module.EXPERT_FP8_EXACT, x))


def combine_add_rmsnorm(
    route_out: Tensor,  # [T*k, H] float32 (or the model dtype)
    weights: Tensor,  # [T, k] float32
    residual: Tensor,  # [T, H]
    norm_weight: Tensor,  # [H]
    eps: float,
    *,
    route_rows: Tensor | None = None,  # [T*k] int64: row of route t*k + rank in route_out (None: that row)
    pdl: bool = False,
    centred: bool = False,  # the next norm scales by (1 + w) (CenteredRMSNorm)
) -> tuple[Tensor, Tensor]:
    """(normed, new_residual): new_residual = residual + Σ_rank w·out (float32, rank order)."""
    if not use_triton(residual):
        if route_rows is not None:
            route_out = route_out[route_rows]
        routes = route_out.float()
        done = cpu_rows.add_rmsnorm(routes, residual, norm_weight, eps, centred, route_weights=weights)
        return combine_reference(routes, weights, residual, norm_weight, eps, centred) if done is None else done
    num_tokens, top_k = weights.shape
    hidden = residual.shape[1]
    normed = torch.empty_like(residual)
    new_residual = torch.empty_like(residual)
    _kernels()[2][(num_tokens,)](
        route_out, weights.contiguous(), residual.contiguous(), norm_weight, normed, new_residual,
        route_rows if route_rows is not None else weights, hidden, eps,
        TOP_K=top_k, K_PAD=max(2, next_power_of_2(top_k)), BLOCK=next_power_of_2(hidden),
        HAS_ROWS=route_rows is not None, PDL=pdl, EARLY=early_reads(), CENTRED=centred,
        num_warps=COMBINE_WARPS, **launch_options(pdl),
    )
    return normed, new_residual
