"""The ranks of one model as a torch.distributed group (DESIGN §13): what moves between them.

Two kinds of traffic:
- rows, inside a forward (`gather`, `sum_rows`): every rank ends with the same bits, and a row's
  bits never depend on the other rows of the step (exact mode's row invariance, DESIGN §11).
  So no all-reduce: NCCL and gloo pick a reduction's order by the message's size, which would
  make a row's sum depend on how many rows share the step. Instead every rank's part is
  gathered and added in rank order, element by element.
- commands, between steps (`send` / `receive`): rank 0's runner calls, pickled, over a gloo
  group on the CPU (a GPU group's collectives stay free for the rows): one broadcast of a
  fixed-size buffer for a step's command (torch's broadcast_object_list takes two: the size,
  then the bytes).

NVLink multicast (NVLS) stays off in every process (`NCCL_ENV`): set before the group exists.
"""

from __future__ import annotations

import os
import pickle
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from shared.model.parallel.shard import Shard

# Set in every rank's environment before NCCL initialises: NVLink multicast off in NCCL, PyTorch
# and NVSHMEM (on shared hosts a program using it can take the GPUs out of service).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
STOP = "stop"
COMMAND_BYTES = 16384  # a command's first broadcast: a step's windows fit (a long prompt's chunk takes two)
# torch 2.13 renamed the one-tensor all-gather (the GPU image's older torch has the old name only).
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def free_address(host: str = "127.0.0.1") -> str:
    """host:port of a free TCP port (the group's rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def rank_device(device: str, rank: int) -> torch.device:
    """The device of `rank`: cuda:(i + rank) where `device` is cuda[:i]; the CPU for every rank."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


class ModelGroup:
    def __init__(self, shard: Shard, address: str, device: torch.device, *, timeout_s: float = 600.0) -> None:
        """Join the group of shard.size ranks meeting at `address` (host:port; rank 0 listens)."""
        os.environ.update(NCCL_ENV)
        self.shard = shard
        self.device = device
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"tcp://{address}", rank=shard.rank, world_size=shard.size,
                                timeout=timedelta(seconds=timeout_s))
        self.rows = dist.group.WORLD
        self.commands = dist.new_group(backend="gloo") if backend != "gloo" else self.rows
        self._buffer = torch.zeros(COMMAND_BYTES, dtype=torch.uint8)  # (commands travel on the CPU)

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    # -- rows -------------------------------------------------------------------------------

    def _all(self, part: Tensor) -> Tensor:
        """[size, *part.shape]: every rank's part, stacked in rank order (one collective, into one
        tensor: capturable in a CUDA graph)."""
        part = part.contiguous()
        stacked = torch.empty((self.size * part.shape[0], *part.shape[1:]), dtype=part.dtype, device=part.device)
        _gather_into(stacked, part, group=self.rows)
        return stacked.view(self.size, *part.shape)

    def gather(self, part: Tensor, dim: int) -> Tensor:
        """Every rank's `part` concatenated along `dim` in rank order (the same on every rank)."""
        stacked = self._all(part)  # [size, ..., part.shape[dim], ...]
        return torch.cat(stacked.unbind(0), dim=dim)

    def sum_rows(self, part: Tensor) -> Tensor:
        """Σ over ranks of `part`, added in rank order element by element (the same bits on every
        rank, each element's independent of every other)."""
        stacked = self._all(part)
        total = stacked[0]
        for other in stacked[1:]:
            total = total + other
        return total

    def share(self, tensor: Tensor) -> None:
        """Rank 0's `tensor` into every rank's (same shape and dtype), on the rows' group: on GPUs
        device to device, with no host synchronisation (e.g. tokens sampled on rank 0's device)."""
        dist.broadcast(tensor, src=0, group=self.rows)

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. KV blocks: each rank's free memory differs)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.commands)
        return int(t.item())

    # -- commands ---------------------------------------------------------------------------

    def send(self, command: tuple) -> None:
        """Rank 0: a command to every follower (one broadcast of a fixed-size buffer for the usual
        small command, a second one for the rest of a large one)."""
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        head = self._buffer
        head[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
        first = data[: COMMAND_BYTES - 8]
        head[8 : 8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        dist.broadcast(head, src=0, group=self.commands)
        if len(data) > len(first):
            rest = torch.frombuffer(bytearray(data[len(first) :]), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.commands)

    def receive(self) -> tuple:
        """A follower: rank 0's next command (blocks until it comes)."""
        head = self._buffer
        dist.broadcast(head, src=0, group=self.commands)
        size = int.from_bytes(head[:8].numpy().tobytes(), "little")
        data = head[8 : 8 + min(size, COMMAND_BYTES - 8)].numpy().tobytes()
        if size > len(data):
            rest = torch.empty(size - len(data), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.commands)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def close(self, *, meet: bool = True) -> None:
        """Leave the group. meet: every rank meets first (one leaving while another still holds
        its connections aborts it), unless a rank is gone already; without: leave now (after a
        failure, when the other ranks are not where a meeting could happen)."""
        if not dist.is_initialized():
            return
        if meet:
            try:
                dist.barrier(group=self.commands)
            except RuntimeError:  # (a rank is gone: nothing to meet)
                pass
        dist.destroy_process_group()
