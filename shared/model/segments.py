"""An offloaded trunk forward as CUDA graphs between the host's reads of each layer's routes.

With experts in host memory, the host must see each MoE layer's routes before its experts can
be made resident (shared.model.offload), so the whole window cannot be one graph; run eagerly,
though, the forward is bound by kernel launches from Python. Here a forward over fixed input
tensors (a window runner's static buffers) is captured as one graph per stretch between two
route reads:

    segment 0:      embed, norm, [dense layers], attention + router of the first MoE layer
    segment i:      experts of MoE layer i - 1 (routes mapped to slots on the device by the
                    store's slot map), combine + norm, [dense layers], attention + router of
                    MoE layer i
    last segment:   experts of the last MoE layer, combine + final norm, [dense layers], lm_head

Each segment ends by copying its routes to pinned host memory. A run keeps the GPU one segment
ahead of the host: it replays segment i + 1 on the slot map as it stands, then reads segment
i's routes (waiting for that copy only). When every routed expert was resident the replayed
segment was right; otherwise the misses are copied in (after that segment, which may still
read the victims' slots) and the segment replays again — its inputs are unchanged and it
rewrites the same KV rows. The kernels and their launch settings are the eager forward's, so
the bits are too. A layer that needs more distinct experts than there are slots runs the rest
of that forward eagerly (groups of experts in turn).

Any family's fused forward runs here: segments call only the layer-level methods every family
has with one signature (`embed`, `mix`, `router`, `experts`, `dense`, `decoder_layer`,
`logits`, `next_norms`). A replayed segment is idempotent: it rewrites the same KV rows and, in
the hybrid family, reads each sequence's committed linear-attention state buffer and rewrites
the other (a step never reads the buffer it writes).
"""

from __future__ import annotations

import torch
from torch import Tensor

from shared.model.fused import FusedForward
from shared.model.rows import Rows
from shared.model.kv_cache import PagedKV
from shared.model.offload import Offload


class SegmentedForward:
    def __init__(self, fused: FusedForward, token_ids: Tensor, rows: Rows, kv: PagedKV, *, capture: bool = True) -> None:
        """token_ids [T], rows, kv: the tensors every run reads (their contents may change).
        capture=False: the same segments run eagerly (the CPU's way to test them)."""
        if fused.offload is None:
            raise ValueError("a segmented forward is for a model with offloaded experts")
        self.fused, self.token_ids, self.rows, self.kv = fused, token_ids, rows, kv
        self.offload: Offload = fused.offload
        self.moe_layers = self.offload.moe_layers
        self.norms = fused.next_norms
        num_segments = len(self.moe_layers) + 1
        cuda = token_ids.device.type == "cuda"
        routes = token_ids.shape[0] * max((fused.layers[m].route_width for m in self.moe_layers), default=0)
        self.host_routes = [torch.zeros(routes, dtype=torch.int64, pin_memory=cuda) for _ in self.moe_layers]
        self.routes_copied = [torch.cuda.Event() if cuda else None for _ in self.moe_layers]
        self.outputs: list[tuple[Tensor, ...]] = [()] * num_segments
        self.graphs: list[torch.cuda.CUDAGraph] = []
        if capture:
            pool = torch.cuda.graph_pool_handle()
            for segment in range(num_segments):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[segment] = self._segment(segment)
                self.graphs.append(graph)

    def _replay(self, segment: int) -> None:
        if self.graphs:
            self.graphs[segment].replay()
        else:
            self.outputs[segment] = self._segment(segment)

    def _segment(self, segment: int) -> tuple[Tensor, ...]:
        """Segment `segment`'s work: (post-attention normed, residual, expert_ids, weights) of the
        MoE layer it stops at, or (logits, final-norm hidden) for the last."""
        fused, layers = self.fused, self.fused.layers
        if segment == 0:
            normed, residual = fused.embed(self.token_ids)
            index = 0
        else:
            moe = self.moe_layers[segment - 1]
            post, residual, expert_ids, weights = self.outputs[segment - 1]
            slot_ids = layers[moe].store.slots_of(expert_ids)
            normed, residual = fused.experts(layers[moe], post, residual, self.norms[moe], slot_ids, weights)
            index = moe + 1
        return self._continue(index, normed, residual)

    def _continue(self, index: int, normed: Tensor, residual: Tensor) -> tuple[Tensor, ...]:
        fused, layers = self.fused, self.fused.layers
        for index in range(index, len(layers)):
            layer = layers[index]
            post, post_residual = fused.mix(layer, normed, residual, self.rows, self.kv)
            if layer.moe:
                expert_ids, weights = fused.router(layer, post, self.rows, None)
                segment = self.moe_layers.index(index)
                self.host_routes[segment][: expert_ids.numel()].copy_(expert_ids.reshape(-1), non_blocking=True)
                return post, post_residual, expert_ids, weights
            normed, residual = fused.dense(layer, post, post_residual, self.norms[index])
        return fused.logits(normed), normed

    @torch.inference_mode()
    def run(self) -> tuple[Tensor, Tensor]:
        """(logits [T, vocab] float32, final-norm hidden [T, hidden]): valid until the next run."""
        offload = self.offload
        offload.begin(self.token_ids)
        self._replay(0)
        for segment, moe in enumerate(self.moe_layers):
            self._after(segment)
            store = self.fused.layers[moe].store
            store.ready()  # (a prefetch into its slots may still be copying)
            self._replay(segment + 1)  # on the slot map as it stands: right unless a route missed
            flat = self._read_routes(segment)
            groups = offload.host_routes(moe, flat)
            if len(groups) > 1:
                return self._eager_from(segment)
            if offload.make_resident(moe, groups[0], first=True):
                self._replay(segment + 1)  # after the copies: now right
        return self.outputs[-1]

    def _after(self, segment: int) -> None:
        """Mark where segment `segment`'s routes reach the host (it was just replayed)."""
        if self.routes_copied[segment] is not None:
            self.routes_copied[segment].record()

    def _read_routes(self, segment: int) -> list[int]:
        event = self.routes_copied[segment]
        if event is not None:
            event.synchronize()
        _, _, expert_ids, _ = self.outputs[segment]
        return self.host_routes[segment][: expert_ids.numel()].tolist()

    def _eager_from(self, segment: int) -> tuple[Tensor, Tensor]:
        """The rest of the forward eagerly, from the experts of the segment's MoE layer on."""
        fused, layers = self.fused, self.fused.layers
        moe = self.moe_layers[segment]
        post, residual, expert_ids, weights = self.outputs[segment]
        normed, residual = fused.experts(layers[moe], post, residual, self.norms[moe], expert_ids, weights,
                                          (self.offload, moe))
        for index in range(moe + 1, len(layers)):
            normed, residual = fused.decoder_layer(layers[index], normed, residual, self.norms[index], self.rows,
                                                   self.kv, None, (self.offload, index))
        return fused.logits(normed), normed
