"""Offloaded experts on the fused path, with prefetch hints from the window's tokens.

With a bounded number of device slots per MoE layer (ExpertStore), a layer's routed experts
are known only once its router has run: the forward reads the routes on the host (one
synchronisation per MoE layer), makes those experts resident (LRU; copies on the model's copy
stream, the compute waiting only for them), maps the route ids to slot ids and runs the fused
expert kernels on the slots. A route's result does not depend on which slot or which other
routes share the launch, so the output is bit-for-bit the all-resident forward's (no route is
ever dropped: routing is never changed here, so verification stays lossless). When a window
needs more distinct experts than there are slots, its routes run in groups of at most
num_slots experts, one group resident at a time. A route id at or past the store's
num_experts names a fixed expert (ExpertStore.with_fixed: the hybrid family's shared expert),
resident for good: it runs in the first group.

Prefetch: a verify window's tokens (the head and the drafts) are known before it runs, and an
MoE layer routes a token much as it did the last time it saw that token (most strongly in
the first layers, where the residual is mostly the token's embedding). `RoutingMemory` keeps,
per layer, the experts each token id was last routed to; while layer l's experts run, the
copies of the experts its memory predicts for layer l + 1 are started, so they overlap with
the compute in between. A wrong guess costs only copy bandwidth and a slot.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from shared.model.experts import ExpertStore


class RoutingMemory:
    """Per MoE layer, the experts each token id was last routed to (at most `capacity` token ids
    a layer, least recently seen forgotten first)."""

    def __init__(self, num_layers: int, *, capacity: int = 65536) -> None:
        if num_layers < 1 or capacity < 1:
            raise ValueError(f"num_layers {num_layers} and capacity {capacity} must be >= 1")
        self.capacity = capacity
        self._layers: list[OrderedDict[int, tuple[int, ...]]] = [OrderedDict() for _ in range(num_layers)]

    def record(self, layer: int, token_ids: list[int], expert_ids: list[int]) -> None:
        """expert_ids: the layer's routes, len(token_ids) * top_k, row-major (-1 = dropped)."""
        seen = self._layers[layer]
        top_k = len(expert_ids) // max(1, len(token_ids))
        for row, token in enumerate(token_ids):
            seen[token] = tuple(e for e in expert_ids[row * top_k : (row + 1) * top_k] if e >= 0)
            seen.move_to_end(token)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def predict(self, layer: int, token_ids: list[int]) -> list[int]:
        """Experts the layer will probably route these tokens to, the most often predicted first."""
        seen = self._layers[layer]
        votes = Counter(e for token in token_ids for e in seen.get(token, ()))
        return [expert for expert, _ in votes.most_common()]

    def __len__(self) -> int:
        return sum(len(layer) for layer in self._layers)


@dataclass
class PrefetchCounters:
    predicted: int = 0  # experts the hints named (per layer and window)
    correct: int = 0  # ... that the layer then routed to
    needed: int = 0  # distinct experts the layers routed to

    @property
    def precision(self) -> float:
        return self.correct / self.predicted if self.predicted else 0.0

    @property
    def recall(self) -> float:
        return self.correct / self.needed if self.needed else 0.0


class Offload:
    """The fused forward's expert step for stores with slots (see the module docstring).

    stores: one per trunk layer (None for a dense layer); prefetch: keep a RoutingMemory and
    start the next MoE layer's predicted copies while a layer runs, at most prefetch_limit of
    them a layer (the most often predicted first: a copy takes longer than a layer's compute)."""

    def __init__(self, stores: list[ExpertStore | None], *, prefetch: bool = False, prefetch_limit: int = 2,
                 memory_capacity: int = 65536):
        if prefetch_limit < 1:
            raise ValueError(f"prefetch_limit {prefetch_limit} must be >= 1")
        self.stores = stores
        self.prefetch_limit = prefetch_limit
        self.moe_layers = [i for i, store in enumerate(stores) if store is not None]
        self.next_moe = {a: b for a, b in zip(self.moe_layers, self.moe_layers[1:])}
        self.memory = RoutingMemory(len(stores), capacity=memory_capacity) if prefetch else None
        self.counters = PrefetchCounters()
        self._token_ids: list[int] = []
        self._hints: dict[int, set[int]] = {}
        self._routes: dict[int, tuple[list[int], list[list[int]]]] = {}  # read by host_routes, not yet run

    @property
    def prefetch(self) -> bool:
        return self.memory is not None

    def begin(self, token_ids: Tensor) -> None:  # [T]
        """A forward starts: read its tokens (a synchronisation) and prefetch the first MoE layer."""
        self._token_ids = token_ids.tolist()
        self._hints = {}
        self._routes = {}
        if self.moe_layers:
            self._prefetch(self.moe_layers[0])

    def _prefetch(self, layer: int) -> None:
        if self.memory is None:
            return
        predicted = self.memory.predict(layer, self._token_ids)
        self._hints[layer] = set(predicted)
        self.stores[layer].prefetch(predicted, limit=self.prefetch_limit)

    def host_routes(self, layer: int, flat: list[int]) -> list[list[int]]:
        """A layer's routes, read on the host (flat, T*k): the distinct experts in groups of at
        most num_slots. Counts the hints, teaches the memory."""
        store = self.stores[layer]
        wanted = list(dict.fromkeys(e for e in flat if 0 <= e < store.num_experts))
        self._count(layer, wanted)
        if self.memory is not None:  # (routed experts only: a fixed one is always resident)
            self.memory.record(layer, self._token_ids, [e if e < store.num_experts else -1 for e in flat])
        groups = [wanted[i : i + store.num_slots] for i in range(0, len(wanted), store.num_slots)] or [[]]
        self._routes[layer] = flat, groups
        return groups

    def make_resident(self, layer: int, group: list[int], *, first: bool) -> int:
        """Make a group resident (the compute waits for its copies), then, after the layer's first
        group, start the next MoE layer's prefetch. Returns the misses (experts copied in)."""
        misses = self.stores[layer].ensure(group)
        if first and layer in self.next_moe:
            self._prefetch(self.next_moe[layer])
        return misses

    def slot_ids(self, layer: int, flat: list[int], group: list[int], *, first: bool) -> list[int]:
        """make_resident, and the routes mapped to slots (-1: not in this group)."""
        self.make_resident(layer, group, first=first)
        store = self.stores[layer]
        members = set(group)
        if not store.num_fixed:
            return [store.slot(e) if e in members else -1 for e in flat]
        fixed_slot = store.num_slots - store.num_experts  # route id num_experts + i -> slot num_slots + i
        return [store.slot(e) if e in members else e + fixed_slot if first and e >= store.num_experts else -1
                for e in flat]

    def experts(self, layer: int, normed: Tensor, expert_ids: Tensor, run) -> Tensor:
        """Per-route outputs [T*k, H] float32 of layer `layer`'s routes `expert_ids` [T, k];
        run(slot_ids [T, k]) runs the fused kernels on the store's slot weights."""
        if layer not in self._routes:
            self.host_routes(layer, expert_ids.reshape(-1).tolist())  # the synchronisation
        flat, groups = self._routes.pop(layer)
        out = None
        for number, group in enumerate(groups):
            ids = torch.tensor(self.slot_ids(layer, flat, group, first=number == 0), dtype=expert_ids.dtype)
            part = run(ids.to(expert_ids.device, non_blocking=True).view_as(expert_ids))
            if out is None:
                out = part
            else:  # each route is computed in exactly one group (a fixed expert's in the first)
                members = set(group)
                in_group = torch.tensor([e in members for e in flat]).to(part.device, non_blocking=True)
                out = torch.where(in_group[:, None], part, out)
        return out

    def _count(self, layer: int, wanted: list[int]) -> None:
        hinted = self._hints.pop(layer, None)
        self.counters.needed += len(wanted)
        if hinted is not None:
            self.counters.predicted += len(hinted)
            self.counters.correct += len(hinted.intersection(wanted))


def offload_over(stores: list[ExpertStore | None], *, prefetch: bool) -> Offload | None:
    """An Offload over these stores (one per layer, None: dense) when some keep experts in host memory."""
    if all(store is None or store.all_resident for store in stores):
        return None
    return Offload(stores, prefetch=prefetch)
