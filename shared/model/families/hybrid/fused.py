"""The Qwen3-Next / Qwen3.5-MoE trunk and MTP layer through kernels.fused (DESIGN §6, §11).

The hybrid family's decode/verify windows, decode batches and prefill chunks on the fused,
graph-capturable path, over the same paged KV pool and `Rows` as qwen3_moe's FusedModel:

- a Gated DeltaNet layer: one GEMV of the in-projections (q|k|v|z|b|a), one kernel for the
  causal convolution, the gated delta rule over the window's rows, the gated RMSNorm and the
  output gate (kernels.fused.deltanet), the out-projection as split-K partials summed by the
  residual add + centred norm;
- a gated full-attention layer: one GEMV of q (interleaved with its output gate per head), k
  and v, the centred q/k norms with partial rotary and the KV write, split-KV attention whose
  merge applies the sigmoid gate, the o-projection;
- the MoE block: the router with the shared expert's gate logit as one more column; the shared
  expert runs as expert E of an [E + 1] expert tensor, a (k + 1)-th route weighted by the
  sigmoid of its gate; combine, residual and the next centred norm in one kernel.

No step reads anything on the host, and every launch configuration follows the weight shapes,
so windows capture into CUDA graphs and a row's bits do not depend on its window or batch
(row invariance). A sequence's linear-attention state lives in `LinearStates` (two buffers
per pool slot; a verify window keeps each row's state for the rollback); `Rows.state_in` and
`Rows.state_out` say which buffers a step reads and writes.

Fusing re-points the reference modules' parameters at views of the fused tensors (nothing is
kept twice) and converts Qwen3-Next's grouped in-projections to the split layout (the same
function, rows permuted), so the reference forward stays what the tests compare with
(families/hybrid/layout.py). FP8 weights (shared.model.quantize) take the same places.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.delta_rule import causal_conv, chunked
from kernels.fused import pdl_supported
from kernels.fused.attention import AttentionWorkspace, decode_attention
from kernels.fused.deltanet import gated_delta_step
from kernels.fused.linear import linear, linear_partials, prefill_linear, split_k
from kernels.fused.moe import MAX_FUSED_TOKENS, combine_add_rmsnorm, experts_reference, fused_experts
from kernels.fused.norm import add_rmsnorm, qk_norm_rope_store
from kernels.fused.router import route
from shared.model.experts import ExpertStore, grouped_mm_available
from shared.model.fused import LayerwiseForward
from shared.model.families.hybrid.deltanet import GatedDeltaNet
from shared.model.families.hybrid.layout import split_grouped, with_shared_expert
from shared.model.families.hybrid.modules import DecoderLayer, Qwen3NextModel, SharedMoe
from shared.model.families.hybrid.states import LinearStates
from shared.model.kv_cache import PagedKV
from shared.model.layers import RoutingOptions, fuse_linear_rows
from shared.model.moe import MoceOptions
from shared.model.mtp import fused_mtp_inputs
from shared.model.parallel.group import ModelGroup
from shared.model.parallel.shard import expert_table
from shared.model.offload import Offload, offload_over
from shared.model.quantize import fp8_unsupported, weight_of
from shared.model.rows import Rows, prefill_attention, prefill_rows


def unsupported_reason(model: Qwen3NextModel) -> str | None:
    """Why the fused path cannot run this hybrid model (None when it can)."""
    c = model.config
    if c.linear_conv_kernel_dim != 4:
        return f"linear_conv_kernel_dim {c.linear_conv_kernel_dim} (the fused delta-rule kernel keeps 3 inputs)"
    if c.head_dim & (c.head_dim - 1) or (model.device.type == "cuda" and c.head_dim < 16):
        return f"head_dim {c.head_dim} must be a power of two (and >= 16 on a GPU)"
    if c.num_experts and c.shared_expert_intermediate_size > c.moe_intermediate_size:
        return (f"shared_expert_intermediate_size {c.shared_expert_intermediate_size} exceeds moe_intermediate_size "
                f"{c.moe_intermediate_size} (the shared expert runs as one more routed expert)")
    return fp8_unsupported(model)


class LinearMixer:
    """A Gated DeltaNet layer's weights in the fused layout."""

    def __init__(self, attn: GatedDeltaNet, index: int) -> None:
        self.index = index  # among the linear layers (its state buffers)
        if attn.layout == "grouped":
            split_grouped(attn)
        self.in_proj = fuse_linear_rows([attn.in_proj_qkv, attn.in_proj_z, attn.in_proj_b, attn.in_proj_a])  # [P, H]
        self.conv = attn.conv1d.weight[:, 0]  # [C, K]
        self.A_log, self.dt_bias, self.norm, self.eps = attn.A_log, attn.dt_bias, attn.norm.weight, attn.norm.eps
        self.out = weight_of(attn.out_proj)  # [H, Hv*dv]
        self.out_splits = split_k(*self.out.shape)
        self.shape = dict(num_k_heads=attn.num_k_heads, num_v_heads=attn.num_v_heads, head_k_dim=attn.head_k_dim,
                          head_v_dim=attn.head_v_dim)
        self.module = attn


class AttentionMixer:
    """A gated full-attention layer's weights: q (each head's query then its gate), k, v in one matrix."""

    def __init__(self, layer: DecoderLayer, kv_index: int) -> None:
        attn = layer.self_attn
        self.kv_index = kv_index  # among the full-attention layers (its KV pool layer)
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.qkv = fuse_linear_rows([attn.q_proj, attn.k_proj, attn.v_proj])  # [(2 Hq + 2 Hkv) * D, H]
        self.o = weight_of(attn.o_proj)
        self.o_splits = split_k(*self.o.shape)
        self.q_norm, self.k_norm, self.eps = attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps

    def gate(self, qkv: Tensor) -> Tensor:
        """The output gate [T, Hq, D] as a view of the fused projection's rows."""
        q_cols = 2 * self.num_heads * self.head_dim
        return qkv[:, :q_cols].unflatten(1, (self.num_heads, 2 * self.head_dim))[:, :, self.head_dim :]


class HybridLayer:
    """One decoder layer in the fused layout: its token mixer, norms and MLP."""

    def __init__(self, layer: DecoderLayer, *, linear_index: int, kv_index: int) -> None:
        self.linear = layer.linear
        self.mixer = LinearMixer(layer.linear_attn, linear_index) if layer.linear else AttentionMixer(layer, kv_index)
        self.input_norm = layer.input_layernorm.weight
        self.post_norm = layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.eps
        self.moe = isinstance(layer.mlp, SharedMoe)
        if self.moe:
            self.router = fuse_linear_rows([layer.mlp.gate, layer.mlp.shared_expert_gate])  # [E + 1, H]
            self.router_splits = split_k(*self.router.shape)
            self.top_k, self.normalize = layer.mlp.top_k, layer.mlp.normalize
            self.route_width = self.top_k + 1  # routes a row: the top-k, then the shared expert
            self.store = layer.mlp.store  # the routed experts: residency (MoCE), slots (offload)
            # the kernels' weights [slots + 1, ...]: the slots, then the shared expert
            self.gate_up, self.down = with_shared_expert(layer.mlp)
            # every expert resident: prefill's grouped GEMMs over all E + 1
            self.grouped = ExpertStore(self.gate_up, self.down, device=self.gate_up.device) \
                if self.store.all_resident else None
        else:
            self.gate_up = fuse_linear_rows([layer.mlp.gate_proj, layer.mlp.up_proj])  # [2I, H]
            self.down = weight_of(layer.mlp.down_proj)


class HybridFused(LayerwiseForward):
    """Decode/verify forward of a loaded Qwen3NextModel through the fused kernels."""

    def __init__(self, model: Qwen3NextModel, *, max_rows: int, max_length: int, num_state_slots: int = 0,
                 pdl: bool | None = None, group: ModelGroup | None = None) -> None:
        """num_state_slots: KV pool slots whose linear-attention states this model keeps (the
        verifier's sessions; 0 for an MTP layer alone); max_rows: the most rows of a step.
        pdl: as FusedModel's. (No `invariant`: this family's rows are row-invariant always; its
        projections never go through F.linear / cuBLAS.) group: the ranks of a model split over
        processes (DESIGN §13); the model is the rank's share (families/hybrid/shard.py): its
        routed experts, and with the dense weights split its heads of every token mixer."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the fused path cannot run this model: {reason}")
        self.join(model, group)
        self.model = model
        c = model.config
        self.layers: list[HybridLayer] = []
        linear_index = kv_index = 0
        for layer in model.layers:
            self.layers.append(HybridLayer(layer, linear_index=linear_index, kv_index=kv_index))
            linear_index += layer.linear
            kv_index += not layer.linear
        # after each trunk layer (a lean drafter's model has no trunk)
        self.next_norms = [layer.input_norm for layer in self.layers[1:]] + ([model.norm.weight] if self.layers else [])
        self.mtp_layer = None
        if model.mtp is not None:
            self.mtp_layer = HybridLayer(model.mtp.layers[0], linear_index=-1, kv_index=0)
        self.workspace = AttentionWorkspace(max_rows, c.num_attention_heads, c.head_dim, max_length, model.device)
        self.max_rows = max_rows
        self.cos, self.sin = model.rotary.cos, model.rotary.sin
        self.rotary_dim = model.rotary.cos.shape[-1]
        self.pdl = pdl_supported(model.device) if pdl is None else pdl
        self.states: LinearStates | None = None
        if num_state_slots and linear_index:
            first = next(layer.mixer for layer in self.layers if layer.linear)
            self.states = LinearStates(
                num_layers=linear_index, num_slots=num_state_slots, max_rows=max_rows, conv_dim=first.conv.shape[0],
                conv_width=first.conv.shape[1], num_v_heads=first.shape["num_v_heads"],
                head_k_dim=first.shape["head_k_dim"], head_v_dim=first.shape["head_v_dim"], dtype=model.dtype,
                device=model.device)
            # the Gated DeltaNet kernel's per-(sequence, head) counts (it splits heads along dv):
            # zeros between launches, one buffer for every layer (they run one after another)
            self.arrivals = torch.zeros(max_rows * first.shape["num_v_heads"], dtype=torch.int32, device=model.device)
        self.moce = MoceOptions(model.device)
        # Experts in host memory with device slots: the host reads each MoE layer's routes.
        self.offload = offload_over([layer.store if layer.moe else None for layer in self.layers], prefetch=False)
        if group is not None:
            for layer in self.layers:
                if layer.moe:
                    layer.expert_table = _ranks_table(layer.router.shape[0] - 1, group.shard, model.device)
        self.mtp_offload = None if self.mtp_layer is None else offload_over(
            [self.mtp_layer.store if self.mtp_layer.moe else None], prefetch=False)

    segmented_offload = True  # offloaded forwards replay as graph segments (shared.model.segments)

    @property
    def offloaded(self) -> bool:
        """Whether some experts live in host memory (a forward then reads routes on the host)."""
        return self.offload is not None or self.mtp_offload is not None

    # -- layers -----------------------------------------------------------------------------
    # The layer-level methods have the same names and signatures in every family's fused forward
    # (LayerwiseForward composes them; shared.model.segments runs them between route reads).

    def mix(self, layer: HybridLayer, normed: Tensor, residual: Tensor, rows: Rows, kv: PagedKV) -> tuple[Tensor, Tensor]:
        """The token mixer through its output projection, the residual add and the post norm."""
        if layer.linear:
            out = self._linear_mixer(layer.mixer, normed, rows)
        else:
            out = self._attention_mixer(layer.mixer, normed, rows, kv)
        return add_rmsnorm(self.ranks_partials(out), residual, layer.post_norm, layer.eps, centred=True, pdl=self.pdl)

    def _linear_mixer(self, mixer: LinearMixer, normed: Tensor, rows: Rows) -> Tensor:
        if self.states is None or rows.state_in is None:
            raise ValueError("a linear-attention layer needs its state buffers (num_state_slots, Rows.state_in)")
        keep = rows.max_rows_per_seq > 1  # a window of several rows may be rolled back
        conv, rec, kept_conv, kept_rec = self.states.layer(mixer.index, keep=keep)
        proj = linear(normed, mixer.in_proj, pdl=self.pdl)  # [T, P]
        core = gated_delta_step(proj, mixer.conv, mixer.A_log, mixer.dt_bias, mixer.norm, conv, rec, rows.seq_starts,
                                rows.state_in, rows.state_out, eps=mixer.eps, kept_conv=kept_conv, kept_rec=kept_rec,
                                arrivals=self.arrivals, pdl=self.pdl, **mixer.shape)  # [T, Hv*dv]
        return linear_partials(core, mixer.out, mixer.out_splits, pdl=self.pdl)

    def _attention_mixer(self, mixer: AttentionMixer, normed: Tensor, rows: Rows, kv: PagedKV) -> Tensor:
        keys, values = kv.layers[mixer.kv_index]
        qkv = linear(normed, mixer.qkv, pdl=self.pdl)
        q = qk_norm_rope_store(qkv, mixer.q_norm, mixer.k_norm, self.cos, self.sin, rows.positions, rows.slots, keys,
                               values, kv.block_tables, mixer.num_heads, mixer.num_kv_heads, mixer.eps, centred=True,
                               rotary_dim=self.rotary_dim, q_head_stride=2 * mixer.head_dim, pdl=self.pdl)
        attn = decode_attention(q, keys, values, kv.block_tables, rows.positions, rows.slots, rows.seq_starts,
                                rows.seq_slots, rows.max_rows_per_seq, self.workspace, gate=mixer.gate(qkv), pdl=self.pdl)
        return linear_partials(attn.flatten(1), mixer.o, mixer.o_splits, pdl=self.pdl)

    def dense(self, layer: HybridLayer, normed: Tensor, residual: Tensor, next_norm: Tensor) -> tuple[Tensor, Tensor]:
        """A dense MLP, the residual add and the next layer's centred norm."""
        gate, up = linear(normed, layer.gate_up, pdl=self.pdl).chunk(2, dim=-1)
        out = linear(F.silu(gate) * up, layer.down, out_dtype=None if self.dense_whole else torch.float32, pdl=self.pdl)
        return add_rmsnorm(self.ranks_partials(out), residual, next_norm, layer.eps, centred=True, pdl=self.pdl)

    def router(self, layer: HybridLayer, normed: Tensor, rows: Rows,
               routing: RoutingOptions | None) -> tuple[Tensor, Tensor]:
        """(expert_ids [T, k + 1], weights [T, k + 1] float32): the top-k routes, then the shared
        expert's (id E, weighted by the sigmoid of its gate)."""
        partials = linear_partials(normed, layer.router, layer.router_splits, pdl=self.pdl)
        resident, tables, draft_rows = self.moce(layer.store, layer.top_k, routing)
        return route(partials, layer.top_k, round_to=normed.dtype, normalize=layer.normalize, shared_gate=True,
                     resident=resident, draft_rows=draft_rows, tables=tables, live=rows.live, pdl=self.pdl)

    def experts(self, layer: HybridLayer, normed: Tensor, residual: Tensor, next_norm: Tensor, expert_ids: Tensor,
                weights: Tensor, offload: tuple[Offload, int] | None = None) -> tuple[Tensor, Tensor]:
        """The routes' weighted sum, the residual add and the next layer's centred norm.
        expert_ids index the kernels' weights (slot ids where the caller made them resident)."""
        pdl = self.pdl
        if self.group is not None:
            route_out = self._ranks_routes(layer, normed, expert_ids, offload)
            return combine_add_rmsnorm(route_out, weights, residual, next_norm, layer.eps, centred=True, pdl=pdl)

        def run(ids: Tensor) -> Tensor:  # [T, k + 1] slot ids (the shared expert's: the last slot)
            return fused_experts(normed, ids, layer.gate_up, layer.down, pdl=pdl)

        route_out = run(expert_ids) if offload is None else offload[0].experts(offload[1], normed, expert_ids, run)
        return combine_add_rmsnorm(route_out, weights, residual, next_norm, layer.eps, centred=True, pdl=pdl)

    def _ranks_routes(self, layer: HybridLayer, normed: Tensor, expert_ids: Tensor,
                      offload: tuple[Offload, int] | None = None) -> Tensor:
        """Split over ranks: [T*(k+1), H] float32 route outputs, each computed by the rank that
        holds its expert (rank 0 the shared one; with slots, made resident as in one process) and
        added over ranks in rank order (one owner a route: its one-process bits)."""
        local_ids = layer.expert_table[expert_ids]  # [T, k + 1]: -1 where another rank computes the route
        fused = normed.shape[0] <= MAX_FUSED_TOKENS

        def run(ids: Tensor) -> Tensor:  # this rank's slot ids (its shared expert's: the last slot), -1: none
            if fused:
                return fused_experts(normed, ids, layer.gate_up, layer.down, pdl=self.pdl, zero_dropped=True)
            return experts_reference(normed, ids, layer.gate_up, layer.down)  # (zeros where -1)

        route_out = run(local_ids) if offload is None else offload[0].experts(offload[1], normed, local_ids, run)
        return self.group.sum_rows(route_out)

    # -- forwards ---------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, token_ids: Tensor, rows: Rows, kv: PagedKV,
                routing: RoutingOptions | None = None) -> tuple[Tensor, Tensor]:
        """Trunk rows: logits [T, vocab] float32 and final-norm hidden [T, hidden]. kv: the full-
        attention layers' paged cache; the linear layers' states are self.states' buffers
        rows.state_in / rows.state_out (each sequence's state after its last row is written to
        its state_out buffer; a window of several rows also keeps each row's state)."""
        if rows.positions.shape[0] > MAX_FUSED_TOKENS:
            raise ValueError(f"a window of {rows.positions.shape[0]} rows: the fused path runs at most "
                             f"{MAX_FUSED_TOKENS} (prefill runs longer chunks)")
        return self.trunk_rows(token_ids, rows, kv, routing)

    def embed(self, token_ids: Tensor) -> tuple[Tensor, Tensor]:  # [T]
        """(normed, residual) entering the first layer."""
        first = self.layers[0]
        return add_rmsnorm(self.model.embed_tokens(token_ids), None, first.input_norm, first.eps, centred=True,
                           pdl=self.pdl)

    def logits(self, normed: Tensor) -> Tensor:  # [T, hidden] final-norm rows -> [T, vocab] float32
        return self.ranks_vocab(linear(normed, self.model.lm_head.weight, out_dtype=torch.float32, pdl=self.pdl))

    # -- prefill ----------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, token_ids: Tensor, spans: list[tuple[int, int, int]], kv: PagedKV) -> Tensor:
        """Prompt chunks of one or more sequences in one forward: final-norm hidden [T, hidden].

        spans[i] = (start, count, slot) as FusedModel.prefill's. Projections and experts run as
        GEMMs over every row (cuBLAS, grouped expert GEMMs), attention per chunk (flash,
        bottom-right causal), and each linear layer's convolution and chunked delta rule per
        chunk from the slot's current state buffer, which it updates in place (prefill is never
        rolled back)."""
        model = self.model
        num_rows = token_ids.shape[0]
        positions, slots = prefill_rows(spans, num_rows, model.device)
        if self.offload is not None:
            self.offload.begin(token_ids)  # (no route read of an earlier forward carries over)
        normed, residual = add_rmsnorm(model.embed_tokens(token_ids), None, self.layers[0].input_norm,
                                       self.layers[0].eps, centred=True)
        for index, (layer, next_norm) in enumerate(zip(self.layers, self.next_norms)):
            if layer.linear:
                out = self._prefill_linear(layer.mixer, normed, spans)
            else:
                out = self._prefill_attention(layer.mixer, normed, positions, slots, spans, kv)
            normed, residual = add_rmsnorm(self.ranks_partials(out), residual, layer.post_norm, layer.eps, centred=True)
            if not layer.moe:
                gate, up = prefill_linear(normed, layer.gate_up).chunk(2, dim=-1)
                out = prefill_linear(F.silu(gate) * up, layer.down)
                normed, residual = add_rmsnorm(self.ranks_partials(out), residual, next_norm, layer.eps, centred=True)
                continue
            expert_ids, weights = route(prefill_linear(normed, layer.router), layer.top_k, normalize=layer.normalize,
                                        shared_gate=True)
            if self.group is not None:
                route_out = self._ranks_routes(layer, normed, expert_ids,
                                               None if self.offload is None else (self.offload, index))
                normed, residual = combine_add_rmsnorm(route_out, weights, residual, next_norm, layer.eps, centred=True)
                continue
            if self._grouped_prefill():
                if layer.grouped is not None:  # every expert resident
                    route_out, route_rows = layer.grouped.grouped_sorted(normed, expert_ids)  # [T*(k+1), hidden]
                    normed, residual = combine_add_rmsnorm(route_out, weights, residual, next_norm, layer.eps,
                                                           route_rows=route_rows, centred=True)
                else:  # experts in host memory: groups of them resident in turn, the same bits
                    route_out = layer.store.grouped_routes(normed, expert_ids)  # [T*(k+1), hidden]
                    normed, residual = combine_add_rmsnorm(route_out, weights, residual, next_norm, layer.eps,
                                                           centred=True)
                continue
            experts = fused_experts if num_rows <= MAX_FUSED_TOKENS else experts_reference

            def run(ids: Tensor) -> Tensor:  # [T*(k+1), hidden] f32 (called within this layer's iteration)
                return experts(normed, ids, layer.gate_up, layer.down)

            # with slots: the routed experts resident a group at a time (the same bits per route)
            route_out = run(expert_ids) if self.offload is None else self.offload.experts(index, normed, expert_ids, run)
            normed, residual = combine_add_rmsnorm(route_out, weights, residual, next_norm, layer.eps, centred=True)
        return normed

    def _grouped_prefill(self) -> bool:
        """Whether prefill runs its experts as grouped GEMMs (torch._grouped_mm: bf16 on Hopper)."""
        return grouped_mm_available(self.model.dtype) and self.model.device.type == "cuda"

    def _prefill_linear(self, mixer: LinearMixer, normed: Tensor, spans: list[tuple[int, int, int]]) -> Tensor:
        """A Gated DeltaNet layer over prompt chunks: the convolution and the chunked delta rule
        per chunk from (and into) its slot's current state buffer; [T, Hv*dv] into out_proj."""
        if self.states is None:
            raise ValueError("prefill of linear-attention layers needs state buffers (num_state_slots)")
        attn: GatedDeltaNet = mixer.module
        proj = prefill_linear(normed, mixer.in_proj)  # [T, P]
        conv_dim = mixer.conv.shape[0]
        cores, row = [], 0
        for _, count, slot in spans:
            buffer, _ = self.states.buffers(slot)
            part = proj[row : row + count]
            row += count
            conv_state = self.states.conv[mixer.index, buffer]  # [K-1, C]
            mixed, conv_after = causal_conv(part[:, :conv_dim], mixer.conv, conv_state.transpose(0, 1))
            q, k, v = mixed.split([attn.key_dim, attn.key_dim, attn.value_dim], dim=-1)
            z, b, a = part[:, conv_dim:].split([attn.value_dim, attn.num_v_heads, attn.num_v_heads], dim=-1)
            beta = b.sigmoid()
            g = -attn.A_log.float().exp() * F.softplus(a.float() + attn.dt_bias)
            out, final = chunked(q.reshape(count, attn.num_k_heads, -1), k.reshape(count, attn.num_k_heads, -1),
                                 v.reshape(count, attn.num_v_heads, -1), g, beta, self.states.rec[mixer.index, buffer])
            cores.append(attn.norm(out.reshape(-1, attn.head_v_dim), z.reshape(-1, attn.head_v_dim)).reshape(count, -1))
            conv_state.copy_(conv_after.transpose(0, 1))
            self.states.rec[mixer.index, buffer].copy_(final)
        return prefill_linear(torch.cat(cores), mixer.out)

    def _prefill_attention(self, mixer: AttentionMixer, normed: Tensor, positions: Tensor, slots: Tensor,
                           spans: list[tuple[int, int, int]], kv: PagedKV) -> Tensor:
        keys, values = kv.layers[mixer.kv_index]
        qkv = prefill_linear(normed, mixer.qkv)
        q = qk_norm_rope_store(qkv, mixer.q_norm, mixer.k_norm, self.cos, self.sin, positions, slots, keys, values,
                               kv.block_tables, mixer.num_heads, mixer.num_kv_heads, mixer.eps, centred=True,
                               rotary_dim=self.rotary_dim, q_head_stride=2 * mixer.head_dim)
        attn = prefill_attention(q, kv, mixer.kv_index, spans)  # [T, heads, D]
        gated = (attn.to(normed.dtype) * torch.sigmoid(mixer.gate(qkv))).to(normed.dtype)
        return prefill_linear(gated.flatten(1), mixer.o)

    # -- the MTP layer ----------------------------------------------------------------------

    @torch.inference_mode()
    def forward_mtp(self, hidden: Tensor, next_token_ids: Tensor, rows: Rows, kv: PagedKV,
                    routing: RoutingOptions | None = None, logit_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """MTP rows (see Qwen3NextModel.forward_mtp): logits [T, vocab] float32 (logit_rows: of
        those rows only, as the qwen3_moe family's), MTP output hidden [T, hidden]; kv: the MTP
        layer's paged cache (one layer); routing: MoCE on draft rows."""
        mtp = self.model._require_mtp()
        layer, pdl = self.mtp_layer, self.pdl
        normed, residual = fused_mtp_inputs(mtp, self.model.embed_tokens(next_token_ids), hidden, layer.input_norm,
                                            layer.eps, centred=True, pdl=pdl)
        normed, _ = self.decoder_layer(layer, normed, residual, mtp.norm.weight, rows, kv, routing,
                                       None if self.mtp_offload is None else (self.mtp_offload, 0))
        return self.logits(normed if logit_rows is None else normed.index_select(0, logit_rows)), normed


def _ranks_table(num_experts: int, shard, device: torch.device) -> Tensor:
    """[E + 1] int64: a route id's index in this rank's kernel weights (its routed experts, then
    the shared expert, id E, which rank 0 runs), -1 where another rank runs the route."""
    shared = torch.tensor([num_experts // shard.size if shard.rank == 0 else -1], device=device)
    return torch.cat([expert_table(num_experts, shard, device), shared])
