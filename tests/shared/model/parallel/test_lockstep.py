"""Rank 0's runner and a follower's loop (shared.model.parallel.lockstep, DESIGN §13), with a
scripted group and runners that record their calls: the follower runs rank 0's calls in rank 0's
order, and stops where it cannot stay in step."""

import pytest
import torch

from shared.model.parallel.lockstep import LeaderRunner, follow
from shared.model.parallel.shard import Shard
from shared.model.runner import Window


class Wire:
    """Both ends of a group in one process: rank 0's sends queue up for the follower."""

    def __init__(self) -> None:
        self.sent: list[tuple] = []
        self.shared: list[torch.Tensor] = []

    def end(self, rank: int) -> "End":
        return End(self, rank)


class End:
    """One rank's end of a Wire (the ModelGroup calls lockstep makes)."""

    def __init__(self, wire: Wire, rank: int) -> None:
        self.wire, self.rank, self.shard = wire, rank, Shard(rank, 2)

    def send(self, command: tuple) -> None:
        self.wire.sent.append(command)

    def receive(self) -> tuple:
        return self.wire.sent.pop(0)

    def share(self, tensor: torch.Tensor) -> None:
        if self.rank == 0:
            self.wire.shared.append(tensor.clone())
        else:
            tensor.copy_(self.wire.shared.pop(0))


class Recorder:
    """A runner that records its calls; its slots come from `slots` in turn."""

    device = torch.device("cpu")

    def __init__(self, slots=(0, 1, 2)) -> None:
        self.calls: list[tuple] = []
        self.slots = list(slots)

    def acquire(self, max_length):
        self.calls.append(("acquire", max_length))
        return self.slots.pop(0), None

    def __getattr__(self, name):
        def call(*args):
            if name == "run" and args[0][0].token_ids == [666]:
                raise ValueError("a bad window")
            self.calls.append((name, *[a.tolist() if isinstance(a, torch.Tensor) else a for a in args]))
        return call


def test_a_follower_runs_rank_0_s_calls_in_order():
    wire = Wire()
    leader = LeaderRunner(Recorder(), wire.end(0))
    slot, _ = leader.acquire(64)
    leader.prefill([Window(slot, [1, 2, 3], 0)])
    leader.run([Window(slot, [4], 3)])
    leader.feed_next(torch.tensor([9]))
    leader.run_next()
    leader.settle(slot, 0)
    with pytest.raises(ValueError):
        leader.run([Window(slot, [666], 4)])  # fails here, and alike there: the follower goes on
    leader.release(slot)
    leader.close()
    follower = Recorder()
    assert follow(follower, wire.end(1)) == 8
    assert follower.calls == leader.runner.calls
    assert ("feed_next", [9]) in follower.calls
    with pytest.raises(RuntimeError, match="closed"):
        leader.run([Window(slot, [4], 3)])


def test_a_follower_that_cannot_match_rank_0_s_slot_stops():
    wire = Wire()
    leader = LeaderRunner(Recorder(slots=(0,)), wire.end(0))
    leader.acquire(64)
    with pytest.raises(RuntimeError, match="out of step"):
        follow(Recorder(slots=(1,)), wire.end(1))


def test_only_rank_0_leads():
    with pytest.raises(ValueError, match="only rank 0 leads"):
        LeaderRunner(Recorder(), Wire().end(1))
