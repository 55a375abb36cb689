"""What every family's fused forward offers (DESIGN §11): the one shape the window runner
(shared.model.graphs), the graph segments of an offloaded forward (shared.model.segments), the
engine and the drafter's MTP proposer see, whichever family built it.

A family's fused forward (qwen3_moe's FusedModel, the hybrid's HybridFused) is built by
`shared.model.families.build_fused`; it satisfies the FusedForward Protocol structurally and
inherits what is the same in both from LayerwiseForward. Two levels:

- forwards: `forward` (decode/verify windows and batches of `Rows` over the paged KV),
  `prefill` (prompt chunks), `forward_mtp` (the MTP layer's rows);
- layers: `embed`, `mix` (the token mixer through the post-mixer norm), `router`, `experts`
  (the routes' sum, the residual add and the next norm), `dense`, `decoder_layer` (the four in
  order) and `logits`, each with the same signature in every family, so code that runs a
  forward piecewise (segments between the host's route reads) is written once.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from shared.model.kv_cache import PagedKV
from shared.model.layers import RoutingOptions
from shared.model.offload import Offload
from shared.model.rows import Rows


class LayerwiseForward:
    """What both families' fused forwards share, written once over the layer-level methods:
    a decoder layer (mixer, then the dense MLP or router and experts) and the trunk's rows
    (embed, every layer, logits); and, for a model split over ranks (`group`, DESIGN §13), what
    moves between them."""

    group = None  # shared.model.parallel.group.ModelGroup of a model split over processes, else None

    def step_plan(self, kv: PagedKV):
        """The CPU's one-call step over this cache (kernels.fused.cpu_step.StepPlan), or None
        where a forward runs op by op (the family's own says where the step applies)."""
        return None

    def join(self, model, group) -> None:
        """Take the ranks a model split over processes runs on (None: one process); the model
        must be this rank's share (loaded with the group's shard)."""
        if group is not None and getattr(model, "shard", None) != group.shard:
            raise ValueError(f"rank {group.rank} of {group.size} needs the model loaded with its shard "
                             f"(it holds {getattr(model, 'shard', None)})")
        self.group = group

    @property
    def dense_whole(self) -> bool:
        """One process, or a split one whose dense weights are whole on every rank."""
        return self.group is None or not self.group.shard.splits_dense

    def ranks_partials(self, partials: Tensor, *, dense: bool = True) -> Tensor:
        """Split over ranks: every rank's partial sums of an output projection ([T, splits, H]
        float32, or one [T, H] product) side by side along the split axis, for the consuming
        norm to add in rank order. dense: a dense weight's (gathered where those are split);
        else the routed experts' (always). One process: the partials as they are."""
        if self.group is None or (dense and self.dense_whole):
            return partials
        if partials.dim() == 2:
            partials = partials.float().unsqueeze(1)
        return self.group.gather(partials, dim=1)

    def ranks_vocab(self, logits: Tensor) -> Tensor:
        """Split over ranks with the lm_head split: every rank's share of the vocabulary's logits
        side by side (the last share's padding cut)."""
        if self.dense_whole:
            return logits
        return self.group.gather(logits, dim=1)[:, : self.model.config.vocab_size]

    def decoder_layer(self, layer, normed: Tensor, residual: Tensor, next_norm: Tensor, rows: Rows, kv: PagedKV,
                      routing: RoutingOptions | None = None,
                      offload: tuple[Offload, int] | None = None) -> tuple[Tensor, Tensor]:
        """(normed for the next layer, residual) after one decoder layer. routing: MoCE on draft
        rows (the drafter's MTP layer); offload: (the Offload, this layer's index in it) with slots."""
        normed, residual = self.mix(layer, normed, residual, rows, kv)
        if not layer.moe:
            return self.dense(layer, normed, residual, next_norm)
        expert_ids, weights = self.router(layer, normed, rows, routing)
        return self.experts(layer, normed, residual, next_norm, expert_ids, weights, offload)

    def trunk_rows(self, token_ids: Tensor, rows: Rows, kv: PagedKV,
                   routing: RoutingOptions | None) -> tuple[Tensor, Tensor]:
        """logits [T, vocab] float32 and final-norm hidden [T, hidden] of trunk rows."""
        if self.offload is not None:
            self.offload.begin(token_ids)
        normed, residual = self.embed(token_ids)
        for index, (layer, next_norm) in enumerate(zip(self.layers, self.next_norms)):
            normed, residual = self.decoder_layer(layer, normed, residual, next_norm, rows, kv, routing,
                                                  None if self.offload is None else (self.offload, index))
        return self.logits(normed), normed


class FusedLayer(Protocol):
    moe: bool  # routed experts (else a dense MLP)
    top_k: int  # (MoE layers)
    route_width: int  # (MoE layers) the router's expert_ids columns: top_k, plus any shared expert
    input_norm: Tensor
    eps: float


class FusedForward(Protocol):
    max_rows: int
    layers: list  # [FusedLayer] of the trunk
    mtp_layer: object | None
    next_norms: list[Tensor]  # after each trunk layer: the next layer's input norm, then the final norm
    offload: Offload | None  # routed experts in host memory (the trunk's)
    mtp_offload: Offload | None
    states: object | None  # per-sequence linear-attention states (the hybrid family), else None
    segmented_offload: bool  # offloaded forwards replay as graph segments on CUDA

    @property
    def offloaded(self) -> bool: ...

    def step_plan(self, kv: PagedKV): ...

    def forward(self, token_ids: Tensor, rows: Rows, kv: PagedKV,
                routing: RoutingOptions | None = None) -> tuple[Tensor, Tensor]: ...

    def prefill(self, token_ids: Tensor, spans: list[tuple[int, int, int]], kv: PagedKV) -> Tensor: ...

    def forward_mtp(self, hidden: Tensor, next_token_ids: Tensor, rows: Rows, kv: PagedKV,
                    routing: RoutingOptions | None = None, logit_rows: Tensor | None = None) -> tuple[Tensor, Tensor]: ...

    def embed(self, token_ids: Tensor) -> tuple[Tensor, Tensor]: ...

    def mix(self, layer, normed: Tensor, residual: Tensor, rows: Rows, kv: PagedKV) -> tuple[Tensor, Tensor]: ...

    def router(self, layer, normed: Tensor, rows: Rows, routing: RoutingOptions | None) -> tuple[Tensor, Tensor]: ...

    def experts(self, layer, normed: Tensor, residual: Tensor, next_norm: Tensor, expert_ids: Tensor, weights: Tensor,
                offload: tuple[Offload, int] | None = None) -> tuple[Tensor, Tensor]: ...

    def dense(self, layer, normed: Tensor, residual: Tensor, next_norm: Tensor) -> tuple[Tensor, Tensor]: ...

    def decoder_layer(self, layer, normed: Tensor, residual: Tensor, next_norm: Tensor, rows: Rows, kv: PagedKV,
                      routing: RoutingOptions | None = None,
                      offload: tuple[Offload, int] | None = None) -> tuple[Tensor, Tensor]: ...

    def logits(self, normed: Tensor) -> Tensor: ...
