"""The trunk and MTP forward of decode/verify windows through kernels.fused (DESIGN §11).

Per decoder layer: fused q/k/v projection → q/k norm + RoPE + KV write → split-KV
attention → o projection → residual add + RMSNorm → router (softmax, top-k, renorm) →
fused experts → weighted sum + residual + the next RMSNorm. No step synchronises with the
host and every buffer shape follows the row count, so a forward captures into a CUDA graph —
except with experts offloaded to host memory (shared.model.offload: each MoE layer's routes
are read on the host; on CUDA the window runner replays graph segments between those reads,
shared.model.segments).
On the CPU each op runs its native row kernel (kernels.fused.cpu_rows) or its torch reference
(or, under the Triton interpreter, its kernel); a trunk forward whose every op has its native
kernel runs as one native call instead (kernels.fused.cpu_step: the same kernels in the same
order, so the same bits; `native_step` switches it).

Split over ranks (`group`, DESIGN §13): the model is this rank's share (shared.model.parallel.
shard). Each rank runs only the routes to its own experts (the others zeroed) and the ranks'
route outputs are added before the usual combine — each route has one owner, so the combine sees
one-process bits; with the dense weights split too, the o projection's split-K partials of every
rank are gathered along the split axis and summed by the norm that consumes them, in rank order
(LayerwiseForward.ranks_partials). Every rank ends each layer with the same rows.

Rows are grouped into sequences (`Rows`): each row has a position and a KV slot; all rows
of a sequence share its slot. The KV is paged (`PagedKV`): per layer [num_blocks, block_size,
kv_heads, head_dim] tensors and block tables [slots, max_blocks] — a KVPool's, or one
KVCache seen as a single slot of one block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.fused import cpu_step, pdl_supported, use_triton
from kernels.fused.attention import AttentionWorkspace, decode_attention
from kernels.fused.linear import dense, k_per_split, linear, linear_partials, prefill_linear, split_k
from kernels.fused.moe import MAX_FUSED_TOKENS, combine_add_rmsnorm, fused_experts, silu_mul
from kernels.fused.norm import add_rmsnorm, qk_norm_rope_store
from kernels.fused.paired import pair_bf16
from kernels.fused.router import route
from shared.model.experts import grouped_mm_available
from shared.model.fused import LayerwiseForward
from shared.model.kv_cache import PagedKV
from shared.model.families.qwen3_moe.layers import DecoderLayer
from shared.model.moe import MoceOptions, MoeBlock
from shared.model.mtp import fused_mtp_inputs
from shared.model.families.qwen3_moe.model import Qwen3MoeModel
from shared.model.layers import RoutingOptions, fuse_linear_rows
from shared.model.offload import Offload, offload_over
from shared.model.parallel.group import ModelGroup
from shared.model.parallel.shard import expert_table
from shared.model.quantize import fp8_unsupported, weight_of
from shared.model.rows import Rows, prefill_attention, prefill_rows
from shared.threads import step_threads


def unsupported_reason(model: Qwen3MoeModel) -> str | None:
    """Why the fused path cannot run this model (None when it can)."""
    c = model.config
    if c.attention_bias:
        return "attention_bias is not supported by the fused path"
    if c.head_dim & (c.head_dim - 1):
        return f"head_dim {c.head_dim} is not a power of two"
    if c.head_dim < 16 and model.device.type == "cuda":
        return f"head_dim {c.head_dim} is below 16 (the attention kernel's smallest dot on a GPU)"
    return fp8_unsupported(model)


class FusedLayer:
    """One decoder layer's weights in the fused layout (q/k/v in one matrix)."""

    def __init__(self, layer: DecoderLayer, kv_index: int) -> None:
        attn = layer.self_attn
        self.kv_index = kv_index  # its layer of the paged KV it runs against
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.qkv = fuse_linear_rows([attn.q_proj, attn.k_proj, attn.v_proj])  # [(Hq + 2 Hkv) * D, H]
        self.o = weight_of(attn.o_proj)
        self.o_splits = split_k(*self.o.shape)  # narrow weights: split-K partials, summed by the consumer
        self.q_norm, self.k_norm = attn.q_norm.weight, attn.k_norm.weight
        self.input_norm = layer.input_layernorm.weight
        self.post_norm = layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.eps
        self.moe = isinstance(layer.mlp, MoeBlock)
        if self.moe:
            self.router = weight_of(layer.mlp.gate)
            self.router_splits = split_k(*self.router.shape)
            self.store = layer.mlp.experts
            self.top_k, self.normalize = layer.mlp.top_k, layer.mlp.normalize
            self.route_width = self.top_k  # routes a row (the router's expert_ids columns)
        else:
            self.gate_up = fuse_linear_rows([layer.mlp.gate_proj, layer.mlp.up_proj])  # [2I, H]
            self.down = weight_of(layer.mlp.down_proj)


class FusedModel(LayerwiseForward):
    """Decode/verify forward of a loaded Qwen3MoeModel through the fused kernels."""

    states = None  # no linear-attention layers: no per-sequence state beside the KV pool
    segmented_offload = True  # offloaded forwards replay as graph segments (shared.model.segments)
    native_step = True  # on the CPU, trunk forwards as one native call where it applies (kernels.fused.cpu_step)

    def __init__(self, model: Qwen3MoeModel, *, max_rows: int, max_length: int, pdl: bool | None = None,
                 invariant: bool = True, expert_prefetch: bool = False, group: ModelGroup | None = None) -> None:
        """pdl: launch each kernel as a programmatic dependent of the one before (default: where
        the GPU supports it); kernels then overlap their start with their predecessor's end.
        invariant: a row's bits are its one-row step's whatever shares its window or batch — on
        the GPU by the kernels' launch configurations (at no cost), on the CPU by the torch
        references' row-by-row products (kernels.fused.linear.rowwise_linear), in one forward
        either way. invariant=False: projections through F.linear / cuBLAS, which pick their
        kernel by the row count (bench/invariance.py's yardstick of what invariance costs).
        expert_prefetch: with experts in host memory, prefetch by the routing memory (offload.py;
        off by default: on the H200 it cost more than it hid, docs/PERFORMANCE.md).
        group: the ranks of a model split over processes (shared.model.parallel.group); the
        model must be the rank's share (loaded with its shard)."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the fused path cannot run this model: {reason}")
        self.join(model, group)
        self.model = model
        c = model.config
        self.layers = [FusedLayer(layer, index) for index, layer in enumerate(model.layers)]
        self.mtp_layer = FusedLayer(model.mtp.layers[0], 0) if model.mtp is not None else None
        # after each trunk layer (a lean drafter's model has no trunk)
        self.next_norms = [layer.input_norm for layer in self.layers[1:]] + ([model.norm.weight] if self.layers else [])
        self.workspace = AttentionWorkspace(max_rows, c.num_attention_heads, c.head_dim, max_length, model.device)
        self.max_rows = max_rows
        self.cos, self.sin = model.rotary.cos, model.rotary.sin
        self.moce = MoceOptions(model.device)
        self.pdl = pdl_supported(model.device) if pdl is None else pdl
        self.invariant = invariant
        # Experts in host memory with device slots: the host reads each MoE layer's routes.
        self.offload = offload_over([layer.store if layer.moe else None for layer in self.layers], prefetch=expert_prefetch)
        if group is not None:
            for layer in self.layers:
                if layer.moe:  # the router's experts (all) -> this rank's store index, -1 for another rank's
                    layer.expert_table = expert_table(layer.router.shape[0], group.shard, model.device)
        self.mtp_offload = None if self.mtp_layer is None else offload_over(
            [self.mtp_layer.store if self.mtp_layer.moe else None], prefetch=False)
        self._step_plan_of: tuple[PagedKV, cpu_step.StepPlan | None] | None = None  # the last cache's (one runner, one cache)
        self._paired: dict[str, Tensor] | None = None  # the step's bfloat16 weights (made with its first plan)

    @property
    def offloaded(self) -> bool:
        """Whether some experts live in host memory (a forward is then no longer one graph)."""
        return self.offload is not None or self.mtp_offload is not None

    # -- layers -----------------------------------------------------------------------------

    # The layer-level methods below have the same names and signatures in every family's fused
    # forward (LayerwiseForward composes them; shared.model.segments runs them between the
    # host's route reads).

    def _by_rows(self, num_rows: int) -> bool:
        return not self.invariant and num_rows > 1  # cuBLAS, its kernel chosen by the row count

    def mix(self, layer: FusedLayer, normed: Tensor, residual: Tensor, rows: Rows, kv: PagedKV) -> tuple[Tensor, Tensor]:
        """Attention through the o projection, the residual add and the post-attention norm."""
        keys, values = kv.layers[layer.kv_index]
        tables = kv.block_tables
        num_rows = normed.shape[0]
        pdl = self.pdl
        by_rows = self._by_rows(num_rows)
        qkv = F.linear(normed, dense(layer.qkv, normed.dtype)) if by_rows else linear(normed, layer.qkv, pdl=pdl)
        q = qk_norm_rope_store(qkv, layer.q_norm, layer.k_norm, self.cos, self.sin, rows.positions, rows.slots,
                               keys, values, tables, layer.num_heads, layer.num_kv_heads, layer.eps, pdl=pdl)
        attn = decode_attention(q, keys, values, tables, rows.positions, rows.slots, rows.seq_starts, rows.seq_slots,
                                rows.max_rows_per_seq, self.workspace, pdl=pdl)
        if by_rows:
            o_partials = F.linear(attn.view(num_rows, -1), dense(layer.o, attn.dtype))
        else:
            o_partials = linear_partials(attn.view(num_rows, -1), layer.o, layer.o_splits, pdl=pdl)
        return add_rmsnorm(self.ranks_partials(o_partials), residual, layer.post_norm, layer.eps, pdl=pdl)

    def dense(self, layer: FusedLayer, normed: Tensor, residual: Tensor, next_norm: Tensor) -> tuple[Tensor, Tensor]:
        gate, up = linear(normed, layer.gate_up, pdl=self.pdl).chunk(2, dim=-1)
        # (split over ranks: the rank's share of the intermediate, a float32 partial product)
        out = linear(F.silu(gate) * up, layer.down, out_dtype=None if self.dense_whole else torch.float32, pdl=self.pdl)
        return add_rmsnorm(self.ranks_partials(out), residual, next_norm, layer.eps, pdl=self.pdl)

    def router(self, layer: FusedLayer, normed: Tensor, rows: Rows,
               routing: RoutingOptions | None) -> tuple[Tensor, Tensor]:
        """(expert_ids [T, k], weights [T, k] float32) of an MoE layer's router."""
        num_rows = normed.shape[0]
        resident, tables, draft_rows = self.moce(layer.store, layer.top_k, routing)
        if self._by_rows(num_rows):
            router_partials = F.linear(normed, dense(layer.router, normed.dtype))
        else:
            router_partials = linear_partials(normed, layer.router, layer.router_splits, pdl=self.pdl)
        return route(router_partials, layer.top_k, round_to=normed.dtype, normalize=layer.normalize,
                     resident=resident, draft_rows=draft_rows, tables=tables, pdl=self.pdl,
                     live=rows.live if num_rows <= MAX_FUSED_TOKENS else None)

    def experts(self, layer: FusedLayer, normed: Tensor, residual: Tensor, next_norm: Tensor, expert_ids: Tensor,
                 weights: Tensor, offload: tuple[Offload, int] | None = None) -> tuple[Tensor, Tensor]:
        """The routed experts' weighted sum, the residual add and the next norm. expert_ids
        index the store's weights (slot ids where the caller made them resident itself)."""
        pdl = self.pdl
        if self.group is not None:
            return self._ranks_experts(layer, normed, residual, next_norm, expert_ids, weights, offload)
        if normed.shape[0] <= MAX_FUSED_TOKENS:
            def run(ids: Tensor) -> Tensor:  # [T, k] expert (or slot) ids
                return fused_experts(normed, ids, layer.store.gate_up, layer.store.down, pdl=pdl)

            route_out = run(expert_ids) if offload is None else offload[0].experts(offload[1], normed, expert_ids, run)
            return combine_add_rmsnorm(route_out, weights, residual, next_norm, layer.eps, pdl=pdl)
        out = layer.store.forward(normed, expert_ids, weights.to(normed.dtype))
        return add_rmsnorm(out, residual, next_norm, layer.eps, pdl=pdl)

    def _ranks_experts(self, layer: FusedLayer, normed: Tensor, residual: Tensor, next_norm: Tensor,
                       expert_ids: Tensor, weights: Tensor,
                       offload: tuple[Offload, int] | None = None) -> tuple[Tensor, Tensor]:
        """Split over ranks: this rank's routes (the others' zero; with slots, its experts made
        resident as in one process), every rank's added in rank order (one owner a route: its
        one-process bits), then the combine of one process."""
        local_ids = layer.expert_table[expert_ids]  # [T, k]: -1 where another rank holds the expert
        if normed.shape[0] > MAX_FUSED_TOKENS:
            return self._ranks_dispatch(layer, normed, residual, next_norm, local_ids, weights)

        def run(ids: Tensor) -> Tensor:  # [T, k] this rank's expert (or slot) ids, -1 for another rank's
            return fused_experts(normed, ids, layer.store.gate_up, layer.store.down, pdl=self.pdl, zero_dropped=True)

        route_out = run(local_ids) if offload is None else offload[0].experts(offload[1], normed, local_ids, run)
        return combine_add_rmsnorm(self.group.sum_rows(route_out), weights, residual, next_norm, layer.eps,
                                   pdl=self.pdl)

    def _ranks_dispatch(self, layer: FusedLayer, normed: Tensor, residual: Tensor, next_norm: Tensor,
                        local_ids: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
        """Split over ranks, many rows (prompts): this rank's experts' weighted sum by the store's
        dispatch path (slots made resident there), the ranks' sums added by the norm."""
        out = layer.store.forward(normed, local_ids, weights.to(normed.dtype), path="dispatch")
        return add_rmsnorm(self.ranks_partials(out, dense=False), residual, next_norm, layer.eps, pdl=self.pdl)

    # -- forwards ---------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, token_ids: Tensor, rows: Rows, kv: PagedKV,
                routing: RoutingOptions | None = None) -> tuple[Tensor, Tensor]:
        """Trunk rows: logits [T, vocab] float32 and final-norm hidden [T, hidden].

        token_ids [T]; kv: the paged cache of every trunk layer.
        """
        step = self.step_plan(kv) if routing is None and token_ids.shape[0] <= cpu_step.MAX_ROWS else None
        if step is not None:
            return step.run(token_ids, rows.positions, rows.slots, rows.live, step_threads())
        return self.trunk_rows(token_ids, rows, kv, routing)

    def step_plan(self, kv: PagedKV) -> cpu_step.StepPlan | None:
        """The CPU step's plan over this cache (made at its first forward), or None where a forward
        runs op by op: on a GPU, under the Triton interpreter, with experts in host memory, split
        over ranks, a dense layer, the reference products (invariant=False), or a layout or weight
        format the step does not read."""
        if not self.native_step or self.model.device.type != "cpu":
            return None
        held = self._step_plan_of
        if held is not None and held[0] is kv:
            return held[1]
        model = self.model
        step = None
        if (not use_triton(model.embed_tokens.weight) and self.invariant and self.group is None
                and self.offload is None and self.layers and all(layer.moe for layer in self.layers)):
            paired = self._paired_weights()
            weights = paired or {}
            step = cpu_step.plan(model.embed_tokens.weight, weights.get("lm_head", model.lm_head.weight), self.cos,
                                 self.sin, kv.block_tables,
                                 [self._step_layer(index, next_norm, kv, weights) for index, next_norm in enumerate(self.next_norms)],
                                 self.layers[0].num_heads, self.layers[0].num_kv_heads, paired=paired is not None)
        self._step_plan_of = (kv, step)
        return step

    def _paired_weights(self) -> dict[str, Tensor] | None:
        """The step's products' and experts' weights as bfloat16 in the paired layout (made once),
        where the model computes in float32 and every such weight is exactly a bfloat16 (a
        bfloat16 checkpoint): the step reads half the bytes for the same bits. None otherwise.
        (They sit beside the float32 weights, which prefill and the per-op path read.)"""
        if self._paired is None:
            weights = {"lm_head": self.model.lm_head.weight}
            for index, layer in enumerate(self.layers):
                weights |= {f"{index}.qkv": layer.qkv, f"{index}.o": layer.o,
                            f"{index}.gate_up": layer.store.gate_up, f"{index}.down": layer.store.down}
            paired = {}
            for name, weight in weights.items():
                paired[name] = pair_bf16(weight) if isinstance(weight, Tensor) else None
                if paired[name] is None:
                    paired = {}
                    break
            self._paired = paired
        return self._paired or None

    def _step_layer(self, index: int, next_norm: Tensor, kv: PagedKV, paired: dict[str, Tensor]) -> cpu_step.StepLayer:
        layer = self.layers[index]
        keys, values = kv.layers[layer.kv_index]
        dtype = self.model.dtype
        return cpu_step.StepLayer(
            input_norm=layer.input_norm, qkv=paired.get(f"{index}.qkv", layer.qkv), q_norm=layer.q_norm,
            k_norm=layer.k_norm, o=paired.get(f"{index}.o", layer.o),
            o_splits=layer.o_splits, o_step=k_per_split(layer.o, dtype, layer.o_splits), post_norm=layer.post_norm,
            router=layer.router, router_splits=layer.router_splits,
            router_step=k_per_split(layer.router, dtype, layer.router_splits), top_k=layer.top_k,
            normalize=layer.normalize, gate_up=paired.get(f"{index}.gate_up", layer.store.gate_up),
            down=paired.get(f"{index}.down", layer.store.down), next_norm=next_norm,
            keys=keys, values=values, eps=layer.eps)

    def embed(self, token_ids: Tensor) -> tuple[Tensor, Tensor]:  # [T]
        """(normed, residual) entering the first layer."""
        first = self.layers[0]
        return add_rmsnorm(self.model.embed_tokens(token_ids), None, first.input_norm, first.eps, pdl=self.pdl)

    def logits(self, normed: Tensor) -> Tensor:  # [T, hidden] final-norm rows -> [T, vocab] float32
        if not self.invariant and normed.shape[0] > 1:
            logits = F.linear(normed, self.model.lm_head.weight).float()
        else:
            logits = linear(normed, self.model.lm_head.weight, out_dtype=torch.float32, pdl=self.pdl)
        return self.ranks_vocab(logits)

    @torch.inference_mode()
    def prefill(self, token_ids: Tensor, spans: list[tuple[int, int, int]], kv: PagedKV) -> Tensor:
        """Prompt chunks of one or more sequences in one forward: final-norm hidden [T, hidden].

        token_ids [T] holds the chunks back to back; spans[i] = (start, count, slot): chunk i sits
        at positions start..start+count-1 of `slot`. Prefill is compute-bound GEMMs: cuBLAS and
        grouped expert GEMMs over every row at once, flash attention per chunk (causal, bottom-right
        aligned over its slot's first start + count positions), the fused kernels doing the per-row
        steps between them. No logits: prompt rows need none."""
        model = self.model
        num_rows = token_ids.shape[0]
        positions, slots = prefill_rows(spans, num_rows, model.device)
        grouped = grouped_mm_available(model.dtype) and model.device.type == "cuda"
        host_ids = token_ids.tolist() if self.offload is not None and self.offload.prefetch else None
        normed, residual = add_rmsnorm(model.embed_tokens(token_ids), None, self.layers[0].input_norm,
                                       self.layers[0].eps)
        for index, (layer, next_norm, (keys, values)) in enumerate(zip(self.layers, self.next_norms, kv.layers)):
            qkv = prefill_linear(normed, layer.qkv)
            q = qk_norm_rope_store(qkv, layer.q_norm, layer.k_norm, self.cos, self.sin, positions, slots,
                                   keys, values, kv.block_tables, layer.num_heads, layer.num_kv_heads, layer.eps)
            attn = prefill_attention(q, kv, index, spans)
            out = prefill_linear(attn.reshape(num_rows, -1), layer.o)
            normed, residual = add_rmsnorm(self.ranks_partials(out), residual, layer.post_norm, layer.eps)
            if not layer.moe:
                out = prefill_linear(silu_mul(prefill_linear(normed, layer.gate_up)), layer.down)
                normed, residual = add_rmsnorm(self.ranks_partials(out), residual, next_norm, layer.eps)
                continue
            expert_ids, weights = route(prefill_linear(normed, layer.router), layer.top_k, normalize=layer.normalize)
            if self.group is not None:  # (as one process's prefill: the dispatch path)
                normed, residual = self._ranks_dispatch(layer, normed, residual, next_norm,
                                                        layer.expert_table[expert_ids], weights)
                continue
            if host_ids is not None:  # the prompt's routes: what the window prefetches learn from
                self.offload.memory.record(index, host_ids, expert_ids.reshape(-1).tolist())
            if grouped and layer.store.all_resident:
                route_out, route_rows = layer.store.grouped_sorted(normed, expert_ids)  # [T*k, hidden], [T*k]
                normed, residual = combine_add_rmsnorm(route_out, weights, residual, next_norm, layer.eps,
                                                       route_rows=route_rows)
            elif grouped:  # experts in host memory: groups of them resident in turn, the same bits
                normed, residual = combine_add_rmsnorm(layer.store.grouped_routes(normed, expert_ids), weights,
                                                       residual, next_norm, layer.eps)
            else:
                out = layer.store.forward(normed, expert_ids, weights.to(normed.dtype))
                normed, residual = add_rmsnorm(out, residual, next_norm, layer.eps)
        return normed

    @torch.inference_mode()
    def forward_mtp(self, hidden: Tensor, next_token_ids: Tensor, rows: Rows, kv: PagedKV,
                    routing: RoutingOptions | None = None, logit_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """MTP rows (see Qwen3MoeModel.forward_mtp): logits [T, vocab] float32 (logit_rows: of
        those rows only, [len(logit_rows), vocab]: a catch-up reads its last row's alone, and the
        lm_head's row-invariant product gives that row the same bits), MTP output hidden [T,
        hidden]; kv: the MTP layer's paged cache (one layer)."""
        model = self.model
        mtp = model._require_mtp()
        layer = self.mtp_layer
        pdl = self.pdl
        normed, residual = fused_mtp_inputs(mtp, model.embed_tokens(next_token_ids), hidden, layer.input_norm,
                                            layer.eps, centred=False, pdl=pdl)
        normed, _ = self.decoder_layer(layer, normed, residual, mtp.norm.weight, rows, kv, routing,
                                       None if self.mtp_offload is None else (self.mtp_offload, 0))
        heads = normed if logit_rows is None else normed.index_select(0, logit_rows)
        return linear(heads, model.lm_head.weight, out_dtype=torch.float32, pdl=pdl), normed

