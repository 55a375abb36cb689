"""The Qwen3-Next / Qwen3.5-MoE trunk and its MTP layer on the reference path (issue 17):
linear-attention (Gated DeltaNet) and gated full-attention layers per `layer_types`,
zero-centred RMSNorms, routed experts plus a sigmoid-gated shared expert. Checked against
transformers' Qwen3NextForCausalLM and Qwen3_5MoeForCausalLM (text); the checkpoints' loader
is shared.model.families.hybrid.loader; the fused GPU path is shared.model.families.hybrid.fused.
Routed experts run through an ExpertStore (all resident, or device slots with the experts in
host memory) and route as qwen3_moe's do (shared.model.moe.MoeBlock: MoCE on a drafter's
draft rows where asked).

A sequence's memory (`HybridCache`) is the KV rows of the full-attention layers and the
state of each linear-attention layer. A window run with keep_states (the default of
`forward`: a verify window may be rolled back) keeps every row's linear state, so
`truncate` after rejected drafts restores both: the KV length moves back, and each linear
layer takes the state after the last row kept.

The MTP layer (`mtp.*`, as the checkpoints name it) is one gated full-attention decoder
layer with the MoE block: x = fc(cat([norm_e(embed(token)), norm_h(h)])) → layer → mtp.norm
→ lm_head, h the trunk's final-norm hidden row (or the MTP's own output when chaining).
`trunk=False` builds the embeddings, the MTP layer and lm_head only: a lean drafter.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.bias import causal_lower_right

from kernels.fused.fp8 import FP8_DTYPE, Fp8Weight
from kernels.fused.linear import Weight
from shared.model.families.hybrid.config import NextConfig
from shared.model.families.hybrid.deltanet import GatedDeltaNet, LinearState
from shared.model.kv_cache import KVCache
from shared.model.experts import ExpertStore
from shared.model.layers import DenseMLP, Rotary, RoutingOptions
from shared.model.moe import MoeBlock
from shared.model.mtp import MTPLayer


class CenteredRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight), in float32 (Qwen3-Next's norms; weights start at zero)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GatedAttention(nn.Module):
    """Full attention with an output gate (q_proj yields each head's query and gate), q/k norms
    and rotary embedding on the first `rotary_dim` of each head's dimensions."""

    def __init__(self, c: NextConfig) -> None:
        super().__init__()
        h, d = c.hidden_size, c.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, d
        self.q_proj = nn.Linear(h, 2 * self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = CenteredRMSNorm(d, c.rms_norm_eps)
        self.k_norm = CenteredRMSNorm(d, c.rms_norm_eps)

    def forward(self, x: Tensor, positions: Tensor, keys: Tensor, values: Tensor, rotary: Rotary,
                visible: int) -> Tensor:
        """x [T, hidden] at positions [T] (consecutive); keys/values [max_length, kv_heads, d] of
        this layer, the window's rows written before attending over the first `visible` rows
        (positions[-1] + 1, known on the host: no device read)."""
        rows, d = x.shape[0], self.head_dim
        q, gate = self.q_proj(x).view(rows, self.num_heads, 2 * d).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(rows, self.num_kv_heads, d))
        v = self.v_proj(x).view(rows, self.num_kv_heads, d)
        width = rotary.cos.shape[-1]
        q = torch.cat([rotary(q[..., :width], positions), q[..., width:]], dim=-1)
        k = torch.cat([rotary(k[..., :width], positions), k[..., width:]], dim=-1)
        keys[positions], values[positions] = k, v
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys[:visible].transpose(0, 1).unsqueeze(0),
            values[:visible].transpose(0, 1).unsqueeze(0), attn_mask=causal_lower_right(rows, visible),
            enable_gqa=self.num_heads != self.num_kv_heads,
        )[0].transpose(0, 1).reshape(rows, -1)
        return self.o_proj(out * torch.sigmoid(gate.reshape(rows, -1)))


class Experts(nn.Module):
    """Routed experts as [E, 2I, H] gate/up and [E, H, I] down parameters (the checkpoints'
    names, so state dicts load), run by an ExpertStore (`store`): over these very tensors with
    every expert resident, or after `offload` through device slots, the parameters then the
    store's host copies."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden, intermediate))
        self.block: tuple[int, int] | None = None  # FP8 blocks once quantized (then *_scale_inv too)
        self._store: ExpertStore | None = None

    @property
    def store(self) -> ExpertStore:
        if self._store is None:
            self._store = ExpertStore(*self._weights(), device=self.gate_up_proj.device)
        return self._store

    def _weights(self) -> tuple[Weight, Weight]:
        """(gate_up, down) as the parameters hold them: tensors, or FP8 with their scales (quantize)."""
        if self.block is None:
            return self.gate_up_proj, self.down_proj
        return (Fp8Weight(self.gate_up_proj, self.gate_up_proj_scale_inv, self._gate_up_block),
                Fp8Weight(self.down_proj, self.down_proj_scale_inv, self.block))

    def keep(self, owned: range) -> None:
        """Only the experts `owned` (a rank's share of a model split over processes,
        shared.model.parallel): on the meta device before allocation, or cut from the weights
        made; full precision (a share is quantized after it is cut)."""
        if self.block is not None:
            raise ValueError("FP8 experts are cut to a rank's share before they are held FP8")
        self.gate_up_proj = nn.Parameter(self.gate_up_proj.data[owned.start : owned.stop].clone(), requires_grad=False)
        self.down_proj = nn.Parameter(self.down_proj.data[owned.start : owned.stop].clone(), requires_grad=False)
        self._store = None

    def hold_fp8(self, block: tuple[int, int], *, per_row_gate_up: bool) -> None:
        """Unfilled FP8 parameters in place of the full-precision ones (a loader copies an FP8
        checkpoint's experts into them; on the meta device, before the model is allocated).
        per_row_gate_up: gate_up's scales one per row (the gate's rows end mid-block)."""
        num_experts, rows, hidden = self.gate_up_proj.shape
        inter, device = self.down_proj.shape[2], self.gate_up_proj.device
        gate_up_block = (1, block[1]) if per_row_gate_up else block
        for name, shape, blk in (("gate_up_proj", (num_experts, rows, hidden), gate_up_block),
                                 ("down_proj", (num_experts, hidden, inter), block)):
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=FP8_DTYPE, device=device), requires_grad=False))
            scale = (num_experts, -(-shape[1] // blk[0]), -(-shape[2] // blk[1]))
            setattr(self, name + "_scale_inv", nn.Parameter(torch.empty(scale, device=device), requires_grad=False))
        self.block = block
        self._gate_up_block = gate_up_block
        self._store = None

    def quantize(self, block: tuple[int, int]) -> None:
        """Make the experts block-scaled FP8 in place (every expert resident): the store's FP8
        stacks become the parameters (values `*_proj`, scales `*_proj_scale_inv`)."""
        store = self.store
        store.quantize(block)
        self._hold(store)

    def _hold(self, store: ExpertStore) -> None:
        """The parameters become the store's weights: its device stacks, or with slots its host
        copies (nothing kept twice)."""
        gate_up, down = (store.gate_up, store.down) if store.all_resident else (store.host_gate_up, store.host_down)
        if store.fp8:
            self.gate_up_proj = nn.Parameter(gate_up.q, requires_grad=False)
            self.gate_up_proj_scale_inv = nn.Parameter(gate_up.scale, requires_grad=False)
            self.down_proj = nn.Parameter(down.q, requires_grad=False)
            self.down_proj_scale_inv = nn.Parameter(down.scale, requires_grad=False)
            self.block, self._gate_up_block = down.block, gate_up.block
        else:
            self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
            self.down_proj = nn.Parameter(down, requires_grad=False)

    def offload(self, num_slots: int, *, device: torch.device, copy_stream: torch.cuda.Stream | None = None,
                prefetch_stream: torch.cuda.Stream | None = None) -> ExpertStore:
        """Keep the experts in host memory with `num_slots` device slots (the parameters become
        the store's host copies: nothing is kept twice)."""
        store = ExpertStore(*self._weights(), device=device, num_slots=num_slots, copy_stream=copy_stream,
                            prefetch_stream=prefetch_stream)
        if not store.all_resident:
            self._hold(store)
        self._store = store
        return store

    def adopt(self, store: ExpertStore) -> None:
        """Point the parameters at the store's weights again after it moved them (with_fixed)."""
        if store.all_resident:
            self._hold(store)

    def _apply(self, fn, recurse=True):
        # A move or cast (model.to) makes new parameters: an all-resident store is rebuilt over
        # them; experts in host memory stay where their store keeps them.
        if self._store is not None and not self._store.all_resident:
            raise ValueError("experts offloaded to host memory do not move with the model")
        if self.block is not None and fn(torch.empty(0, dtype=FP8_DTYPE, device=self.gate_up_proj.device)).dtype != FP8_DTYPE:
            raise ValueError("an FP8 model's weights do not change dtype (--dtype is the activations')")
        self._store = None
        return super()._apply(fn, recurse)


class SharedMoe(MoeBlock):
    """The routed experts (softmax top-k, MoCE on draft rows where asked) plus a shared expert
    scaled by a sigmoid gate."""

    def __init__(self, c: NextConfig) -> None:
        h = c.hidden_size
        super().__init__(h, c.num_experts, c.num_experts_per_tok, normalize=c.norm_topk_prob)
        self.experts = Experts(c.num_experts, h, c.moe_intermediate_size)
        self.shared_expert = DenseMLP(h, c.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    @property
    def store(self) -> ExpertStore:
        return self.experts.store

    def forward(self, x: Tensor, routing: RoutingOptions | None = None) -> Tensor:
        routed = super().forward(x, routing)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DecoderLayer(nn.Module):
    def __init__(self, c: NextConfig, index: int, *, mtp: bool = False) -> None:
        """Trunk layer `index` per the config, or (mtp) the MTP layer: full attention, MoE."""
        super().__init__()
        self.linear = not mtp and c.layer_types[index] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(
                hidden_size=c.hidden_size, num_k_heads=c.linear_num_key_heads,
                num_v_heads=c.linear_num_value_heads, head_k_dim=c.linear_key_head_dim,
                head_v_dim=c.linear_value_head_dim, conv_kernel=c.linear_conv_kernel_dim, eps=c.rms_norm_eps,
                layout=c.linear_projection)
        else:
            self.self_attn = GatedAttention(c)
        sparse = c.num_experts > 0 and (mtp or index not in c.mlp_only_layers and (index + 1) % c.decoder_sparse_step == 0)
        self.mlp = SharedMoe(c) if sparse else DenseMLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = CenteredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = CenteredRMSNorm(c.hidden_size, c.rms_norm_eps)

    def attend(self, x: Tensor, positions: Tensor, keys: Tensor, values: Tensor, rotary: Rotary,
               visible: int, routing: RoutingOptions | None = None) -> Tensor:
        """A full-attention layer's whole step: x [T, hidden] → x [T, hidden]."""
        x = x + self.self_attn(self.input_layernorm(x), positions, keys, values, rotary, visible)
        return x + self.mlp(self.post_attention_layernorm(x), routing)


class HybridCache:
    """One sequence's memory: KV rows of the full-attention layers, state of the linear ones."""

    def __init__(self, model: Qwen3NextModel, max_length: int) -> None:
        c = model.config
        num_full = sum(1 for layer in model.layers if not layer.linear)
        self.kv = KVCache(num_layers=max(num_full, 1), max_length=max_length, num_kv_heads=c.num_key_value_heads,
                          head_dim=c.head_dim, dtype=model.dtype, device=model.device)
        self.linear: list[LinearState] = [layer.linear_attn.new_state() for layer in model.layers if layer.linear]
        # the last window run with keep_states: (its first row, the states before it, each linear
        # layer's state after each of its rows)
        self.window: tuple[int, list[LinearState], list[list[LinearState]]] | None = None

    @property
    def length(self) -> int:
        return self.kv.length

    @property
    def max_length(self) -> int:
        return self.kv.max_length

    def truncate(self, length: int) -> None:
        """Keep the first `length` rows: the KV rows beyond go, and each linear layer takes its
        state after row length - 1 (a window run with keep_states keeps them)."""
        if length == self.kv.length or not self.linear:
            self.kv.truncate(length)
            return
        if self.window is None:
            raise ValueError("rolling back linear-attention state needs the window run with keep_states=True")
        start, before, rows = self.window
        if not start <= length <= start + len(rows[0]):
            raise ValueError(f"cannot roll back to row {length}: the last window covers rows {start}.."
                             f"{start + len(rows[0])}")
        self.linear = list(before) if length == start else [states[length - start - 1] for states in rows]
        self.kv.truncate(length)


class Qwen3NextModel(nn.Module):
    def __init__(self, config: NextConfig, *, trunk: bool = True) -> None:
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers) if trunk)
        self.norm = CenteredRMSNorm(c.hidden_size, c.rms_norm_eps) if trunk else None
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.mtp = MTPLayer(c.hidden_size, c.rms_norm_eps, norm=CenteredRMSNorm, layer=DecoderLayer(c, 0, mtp=True)) \
            if c.mtp_num_hidden_layers else None
        rotary_dim = int(c.head_dim * c.partial_rotary_factor)
        self.rotary = Rotary(rotary_dim, c.rope_theta, c.max_position_embeddings)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep KV rows (the full-attention ones)."""
        return sum(1 for layer in self.layers if not layer.linear)

    def _check_length(self, max_length: int) -> None:
        if max_length > self.config.max_position_embeddings:
            raise ValueError(f"cache length {max_length} exceeds max_position_embeddings "
                             f"{self.config.max_position_embeddings}")

    def new_cache(self, max_length: int) -> HybridCache:
        self._check_length(max_length)
        if not self.layers:
            raise ValueError("this model was loaded without its trunk (a lean drafter's MTP layer only)")
        return HybridCache(self, max_length)

    def new_mtp_cache(self, max_length: int) -> KVCache:
        self._require_mtp()
        self._check_length(max_length)
        c = self.config
        return KVCache(num_layers=1, max_length=max_length, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                       dtype=self.dtype, device=self.device)

    def _require_mtp(self) -> MTPLayer:
        if self.mtp is None:
            raise ValueError("this checkpoint has no MTP layer (no mtp.* tensors)")
        return self.mtp

    @torch.inference_mode()
    def forward(self, token_ids: Tensor, cache: HybridCache, *, keep_states: bool = True,
                row_invariant: bool = False) -> tuple[Tensor, Tensor]:
        """A window after the cache's rows: logits [T, vocab] float32 and final-norm hidden
        [T, hidden]. keep_states: every row's linear state is kept for `cache.truncate` (a
        verify window's rollback). row_invariant (CPU): the window runs as its rows' one-row
        steps, so each row's bits are the decoded row's (exact mode; as Qwen3MoeModel.forward)."""
        rows = token_ids.shape[0]
        if row_invariant and self.device.type == "cpu" and rows > 1:
            start, before, per_row, outs = cache.length, list(cache.linear), [[] for _ in cache.linear], []
            for i in range(rows):
                outs.append(self._trunk(token_ids[i : i + 1], cache, keep_states=keep_states))
                if keep_states:  # this row's state of each linear layer
                    for states, kept in zip(per_row, cache.window[2]):
                        states.extend(kept)
            cache.window = (start, before, per_row) if keep_states else None
            return torch.cat([self.lm_head(row).float() for row in outs]), torch.cat(outs)  # (lm_head too: one row each)
        hidden = self._trunk(token_ids, cache, keep_states=keep_states)
        return self.lm_head(hidden).float(), hidden

    @torch.inference_mode()
    def prefill(self, token_ids: Tensor, cache: HybridCache) -> Tensor:
        """A prompt chunk into the cache: final-norm hidden [T, hidden] only (no rollback kept)."""
        return self._trunk(token_ids, cache, keep_states=False)

    def _trunk(self, token_ids: Tensor, cache: HybridCache, *, keep_states: bool) -> Tensor:
        start = cache.kv.reserve(token_ids.shape[0])
        positions = torch.arange(start, start + token_ids.shape[0], device=self.device)
        x = self.embed_tokens(token_ids)
        full = linear = 0
        before, per_row = list(cache.linear), []
        for layer in self.layers:
            if layer.linear:
                out, state = layer.linear_attn(layer.input_layernorm(x), cache.linear[linear], keep_states=keep_states)
                if keep_states:
                    per_row.append(state)
                    state = state[-1]
                cache.linear[linear] = state
                linear += 1
                x = x + out
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            else:
                x = layer.attend(x, positions, *cache.kv.layer(full), self.rotary, start + token_ids.shape[0])
                full += 1
        cache.window = (start, before, per_row) if keep_states else None
        return self.norm(x)

    @torch.inference_mode()
    def forward_mtp(self, hidden: Tensor, next_token_ids: Tensor, cache: KVCache, *,
                    routing: RoutingOptions | None = None) -> tuple[Tensor, Tensor]:
        """MTP rows (hidden [T, hidden], the token after each [T]) appended to the MTP cache:
        logits [T, vocab] float32 for the token after next, and the MTP output hidden [T, hidden].
        routing: the MTP proposer's (MoCE routing of its draft rows; None: full routing)."""
        mtp = self._require_mtp()
        start = cache.reserve(hidden.shape[0])
        positions = torch.arange(start, start + hidden.shape[0], device=self.device)
        x = mtp.inputs(self.embed_tokens(next_token_ids), hidden)
        out = mtp.norm(mtp.layers[0].attend(x, positions, *cache.layer(0), self.rotary, start + hidden.shape[0], routing))
        return self.lm_head(out).float(), out
