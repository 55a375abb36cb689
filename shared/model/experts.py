"""Expert store: one MoE layer's routed experts in host memory with a bounded set of device slots.

Every expert's weights live in host memory (pinned on CUDA, so copies are asynchronous);
`num_slots` device slots hold the resident ones, replaced least-recently-used. The slot map
is the residency map handed to routing (`resident_mask`), so MoCE routing prefers experts
already on the device. With all experts resident (the default) the store is a plain stacked
weight tensor and lookups need no host synchronisation.

On CUDA the copies a forward waits for run on a copy stream, and prefetches (`prefetch`:
experts a later forward will probably need) on a second one, so a prefetch never queues in
front of a needed copy (the model's stores share the two streams). The compute stream waits
only for the copies into the slots it is about to read (`ready`). A slot is overwritten only
after the compute queued before the copy (which may still read it) and any copy still
writing it are done.

Weights are stacked in nn.Linear layout: gate_up [experts, 2*intermediate, hidden] (gate
rows first, then up rows) and down [experts, hidden, intermediate].

Fixed experts (`with_fixed`: the hybrid family's shared expert) sit after the slots in the
same device tensors, resident for good, so one fused kernel launch runs routed and shared
routes alike: fixed expert i is slot num_slots + i, and route id num_experts + i names it.

FP8 experts (`quantize`, or block-scaled stacks given as kernels.fused.fp8.Fp8Weight): the
fused kernels read them as they are; the reference paths dequantise the experts they run;
behind slots an expert's copy moves its FP8 values and scales (half bf16's bytes).

The compute paths over the store's weights (dispatch, gather, grouped GEMMs) are
shared.model.expert_paths; this module is residency: slots, copies, prefetches, fixed experts.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.fused.fp8 import Fp8Weight, cat_rows, quantize, stack
from kernels.fused.linear import Weight
from shared.model.expert_paths import ExpertPaths, grouped_mm_available

__all__ = ["ExpertCounters", "ExpertStore", "copy_streams", "grouped_mm_available"]


@dataclass
class ExpertCounters:
    hits: int = 0  # experts found resident when a forward needed them
    misses: int = 0  # experts copied in when a forward needed them (the compute waits)
    bytes_moved: int = 0  # every copy: misses, prefetches and the initial fill
    prefetched: int = 0  # experts copied in ahead by a prefetch
    prefetch_hits: int = 0  # prefetched experts a forward then needed (before their eviction)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 1.0


class ExpertStore(ExpertPaths):
    def __init__(
        self,
        gate_up: Weight,  # [experts, 2*intermediate, hidden]
        down: Weight,  # [experts, hidden, intermediate]
        *,
        device: torch.device | str,
        num_slots: int | None = None,
        copy_stream: torch.cuda.Stream | None = None,
        prefetch_stream: torch.cuda.Stream | None = None,
    ) -> None:
        """copy_stream, prefetch_stream: where needed and prefetched experts are copied on CUDA
        (None: the store makes its own)."""
        num_experts = gate_up.shape[0]
        if down.shape[0] != num_experts or gate_up.shape[2] != down.shape[1] or gate_up.shape[1] != 2 * down.shape[2]:
            raise ValueError(f"gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} are not one set of experts")
        num_slots = num_experts if num_slots is None else num_slots
        if not 1 <= num_slots <= num_experts:
            raise ValueError(f"num_slots {num_slots} must lie in [1, {num_experts}]")
        self.device = torch.device(device)
        self.fp8 = isinstance(gate_up, Fp8Weight)
        if self.fp8 != isinstance(down, Fp8Weight):
            raise ValueError("gate_up and down must both be FP8 or neither")
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.counters = ExpertCounters()
        self.all_resident = num_slots == num_experts
        self.path: str | None = None  # expert path override (benchmarks); None = default_path
        self.num_fixed = 0  # experts kept after the slots for good (with_fixed)
        self.fixed_weights: tuple[Tensor, Tensor] | None = None  # [num_slots + num_fixed, ...] (with_fixed)
        if self.all_resident:
            self.gate_up = gate_up.to(self.device)
            self.down = down.to(self.device)
            self.host_gate_up = self.host_down = None
            self.slot_of_expert = torch.arange(num_experts, device=self.device)
            self._lru: OrderedDict[int, int] = OrderedDict((e, e) for e in range(num_experts))
            self._prefetched: set[int] = set()
            self.copy_stream = self.prefetch_stream = None
            self._copied: dict[int, torch.cuda.Event] = {}
            return
        cuda = self.device.type == "cuda"
        self.host_gate_up = _to_host(gate_up, pin=cuda)
        self.host_down = _to_host(down, pin=cuda)
        self.gate_up = _slots(gate_up, num_slots, self.device)
        self.down = _slots(down, num_slots, self.device)
        # One entry past the experts, always -1: a dropped route (id -1) indexes it (slots_of).
        self._slot_table = torch.full((num_experts + 1,), -1, dtype=torch.int64, device=self.device)
        self.slot_of_expert = self._slot_table[:num_experts]
        self._lru = OrderedDict()  # expert -> slot, least recently used first
        self._prefetched = set()  # prefetched, not yet needed
        self.copy_stream = (copy_stream or torch.cuda.Stream(self.device)) if cuda else None
        self.prefetch_stream = (prefetch_stream or torch.cuda.Stream(self.device)) if cuda else None
        self._copied = {}  # slot -> the event after its latest copy (until the compute waited for it)
        self._copy([(expert, expert) for expert in range(num_slots)])  # start with the first experts resident
        self.ready()

    def with_fixed(self, gate_up: Tensor, down: Tensor) -> tuple[Tensor, Tensor]:
        """Device weights [num_slots + n, ...]: the slots, then n fixed experts (gate_up
        [n, 2I, H], down [n, H, I]) resident for good, slot num_slots + i (route id num_experts + i).
        The slots become views of them (nothing kept twice); a store takes fixed experts once."""
        if self.num_fixed:
            raise ValueError("this store already has its fixed experts")
        if gate_up.shape[1:] != self.gate_up.shape[1:] or down.shape[1:] != self.down.shape[1:]:
            raise ValueError(f"fixed experts {tuple(gate_up.shape)}, {tuple(down.shape)} do not match the slots "
                             f"{tuple(self.gate_up.shape)}, {tuple(self.down.shape)}")
        self.ready()  # copies still landing in the slots finish before the slots are copied over
        if self.fp8:
            all_gate_up = cat_rows([self.gate_up, gate_up.to(self.device)], dim=0)
            all_down = cat_rows([self.down, down.to(self.device)], dim=0)
        else:
            all_gate_up = torch.cat([self.gate_up.detach(), gate_up.to(self.device, self.gate_up.dtype)])
            all_down = torch.cat([self.down.detach(), down.to(self.device, self.down.dtype)])
        self.gate_up, self.down = all_gate_up[: self.num_slots], all_down[: self.num_slots]
        self.num_fixed = gate_up.shape[0]
        if not self.all_resident:  # route id num_experts + i -> slot num_slots + i (slots_of); -1 stays last
            fixed = torch.arange(self.num_slots, self.num_slots + self.num_fixed, device=self.device)
            self._slot_table = torch.cat([self.slot_of_expert, fixed, self._slot_table[-1:]])
            self.slot_of_expert = self._slot_table[: self.num_experts]
        self.fixed_weights = (all_gate_up, all_down)
        return all_gate_up, all_down

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (FP8: its scales too)."""
        if self.fp8:
            return self.gate_up[0].nbytes + self.down[0].nbytes
        return (self.gate_up[0].numel() + self.down[0].numel()) * self.gate_up.element_size()

    def quantize(self, block: tuple[int, int]) -> None:
        """Make the experts block-scaled FP8 in place (before fixed experts are added): an expert
        at a time, so one expert's float32 copy is the most alive at once — on the device, then
        back to host memory for experts behind slots, whose slots then hold FP8 copies."""
        if self.fp8:
            return
        if self.num_fixed:
            raise ValueError("a store quantizes before its fixed experts are added")
        if self.all_resident:
            self.gate_up = stack([quantize(self.gate_up[e], block) for e in range(self.num_experts)])
            self.down = stack([quantize(self.down[e], block) for e in range(self.num_experts)])
            self.fp8 = True
            return
        self.ready()
        cuda = self.device.type == "cuda"
        for name in ("gate_up", "down"):
            host = getattr(self, f"host_{name}")
            experts = [quantize(host[e].to(self.device), block).to("cpu") for e in range(self.num_experts)]
            setattr(self, f"host_{name}", _to_host(stack(experts), pin=cuda))
            setattr(self, name, _slots(getattr(self, f"host_{name}"), self.num_slots, self.device))
        self.fp8 = True
        self._copied = {}
        self._copy(list(self._lru.items()))  # the resident experts again, now FP8
        self.ready()

    def tensors(self) -> list[Tensor]:
        """The device tensors behind the weights (FP8: values and scales)."""
        return [*_tensors(self.gate_up), *_tensors(self.down)]

    def host_tensors(self) -> list[Tensor]:
        """The host copies' tensors (experts behind slots), none with every expert resident."""
        return [] if self.all_resident else [*_tensors(self.host_gate_up), *_tensors(self.host_down)]

    def expert_weights(self, expert: int) -> tuple[Tensor, Tensor]:
        """(gate_up, down) of one expert, wherever it lives."""
        if self.all_resident:
            return self.gate_up[expert], self.down[expert]
        return self.host_gate_up[expert], self.host_down[expert]

    def resident_mask(self) -> Tensor:
        """[experts] bool: which experts sit in a device slot now (the routing residency map)."""
        return self.slot_of_expert >= 0

    def resident_experts(self) -> list[int]:
        """Resident experts, least recently used first."""
        return list(self._lru)

    def slot(self, expert: int) -> int:
        """The device slot holding a resident expert (KeyError if it is not resident)."""
        return expert if self.all_resident else self._lru[expert]

    def _copy(self, moves: list[tuple[int, int]], stream: torch.cuda.Stream | None = None) -> None:
        """Copy expert -> slot for each (expert, slot) pair, on `stream` (default: the copy stream)
        where there is one. The slot map is updated in the compute stream's order (what routing
        and the graph segments read)."""
        if not moves:
            return
        experts, slots = zip(*moves)
        for expert, slot in moves:
            self._lru[expert] = slot
        self.slot_of_expert[list(experts)] = torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
        self.counters.bytes_moved += len(moves) * self.expert_bytes
        stream = stream or self.copy_stream
        if stream is None:
            self._copy_weights(moves)
            return
        # The compute queued so far may still read the victims' slots, and an earlier copy may
        # still be writing one: copy after both.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for _, slot in moves:
            if slot in self._copied:
                stream.wait_event(self._copied[slot])
        with torch.cuda.stream(stream):
            self._copy_weights(moves)
            event = torch.cuda.Event()
            event.record(stream)
        for _, slot in moves:
            self._copied[slot] = event

    def _copy_weights(self, moves: list[tuple[int, int]]) -> None:
        for expert, slot in moves:
            for slots, host in ((self.gate_up, self.host_gate_up), (self.down, self.host_down)):
                for dst, src in zip(_tensors(slots[slot]), _tensors(host[expert])):  # (FP8: values, then scales)
                    dst.copy_(src, non_blocking=True)

    def ready(self, experts: list[int] | None = None) -> None:
        """Make the compute stream wait for the copies into these resident experts' slots (None:
        every slot) before it reads them."""
        slots = list(self._copied) if experts is None else [self._lru[e] for e in experts]
        compute = torch.cuda.current_stream(self.device) if self._copied else None
        for slot in slots:
            event = self._copied.pop(slot, None)
            if event is not None:
                compute.wait_event(event)

    def slots_of(self, expert_ids: Tensor) -> Tensor:
        """The slot of each routed expert [T, k] (-1 stays -1; a fixed expert's id, its slot), on
        the device without the host, in one gather: valid once they are resident."""
        if self.all_resident:
            return expert_ids
        return self._slot_table[expert_ids]

    def _victims(self, count: int, keep: set[int]) -> list[int]:
        """The slots of the `count` least recently used resident experts outside `keep`, evicted."""
        if not count:
            return []
        victims = []
        for expert in self._lru:
            if len(victims) == count:
                break
            if expert not in keep:
                victims.append(expert)
        slots = [self._lru.pop(expert) for expert in victims]
        self._prefetched.difference_update(victims)
        self.slot_of_expert[victims] = -1
        return slots

    def ensure(self, experts: list[int]) -> int:
        """Make `experts` resident (LRU replacement), counting hits and misses; the compute
        stream then waits for their copies (`ready`). Returns the misses (experts copied in).

        Raises ValueError if more distinct experts are asked for at once than there are slots.
        """
        wanted = list(dict.fromkeys(experts))
        if len(wanted) > self.num_slots:
            raise ValueError(f"{len(wanted)} distinct experts needed at once but only {self.num_slots} slots")
        if self.all_resident:
            self.counters.hits += len(wanted)
            return 0
        missing = []
        for expert in wanted:
            if expert in self._lru:
                self.counters.hits += 1
                self._lru.move_to_end(expert)
                if expert in self._prefetched:
                    self._prefetched.discard(expert)
                    self.counters.prefetch_hits += 1
            else:
                missing.append(expert)
        self.counters.misses += len(missing)
        self._copy(list(zip(missing, self._victims(len(missing), set(wanted)))))
        self.ready(wanted)
        return len(missing)

    def prefetch(self, experts: list[int], *, limit: int | None = None) -> int:
        """Start copying in those of `experts` that are not resident (at most `limit` of them),
        on the prefetch stream, without making the compute wait; returns how many copies
        started. A prefetched expert counts as just used (so a wrong guess ages out like any
        other); at most num_slots experts are taken, in order."""
        if self.all_resident:
            return 0
        wanted = list(dict.fromkeys(experts))[: self.num_slots]
        missing = [e for e in wanted if e not in self._lru][:limit]
        for expert in wanted:
            if expert in self._lru:
                self._lru.move_to_end(expert)
        self._copy(list(zip(missing, self._victims(len(missing), set(wanted)))), self.prefetch_stream)
        self._prefetched.update(missing)
        self.counters.prefetched += len(missing)
        return len(missing)


def copy_streams(device: torch.device, num_slots: int | None) -> tuple[torch.cuda.Stream | None, ...]:
    """(copy stream, prefetch stream) that all of a model's expert stores share (None off CUDA
    or with every expert resident)."""
    if device.type != "cuda" or not num_slots:
        return None, None
    return torch.cuda.Stream(device), torch.cuda.Stream(device)


def _to_host(weights: Weight, *, pin: bool) -> Weight:
    """A host copy of `weights` (pinned for asynchronous copies), filled straight from its device."""
    if isinstance(weights, Fp8Weight):
        return Fp8Weight(_to_host(weights.q, pin=pin), _to_host(weights.scale, pin=pin), weights.block)
    host = torch.empty(weights.shape, dtype=weights.dtype, pin_memory=pin)
    host.copy_(weights)
    return host


def _slots(weights: Weight, num_slots: int, device: torch.device) -> Weight:
    """Unfilled device slots [num_slots, ...] for experts like `weights`' (FP8: values and scales)."""
    if isinstance(weights, Fp8Weight):
        return Fp8Weight(_slots(weights.q, num_slots, device), _slots(weights.scale, num_slots, device), weights.block)
    return torch.empty((num_slots, *weights.shape[1:]), dtype=weights.dtype, device=device)


def _tensors(weights: Weight) -> tuple[Tensor, ...]:
    return (weights.q, weights.scale) if isinstance(weights, Fp8Weight) else (weights,)
