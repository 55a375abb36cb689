"""What moves between two ranks (shared.model.parallel.group, DESIGN §13), over gloo: commands of
every size arrive whole (the fixed buffer's, one byte under, and a long prompt's in two
broadcasts), rows are gathered in rank order and summed to the same bits on every rank."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from shared.model.parallel.group import COMMAND_BYTES, ModelGroup, free_address
from shared.model.parallel.shard import Shard

ROOT = Path(__file__).resolve().parents[4]
COMMANDS = [("run", [(0, [5], 19)]), ("prefill", [(1, list(range(COMMAND_BYTES // 2)), 0)]), ("x" * (COMMAND_BYTES - 30),),
            ("stop", ())]


@pytest.fixture
def two_ranks():
    """(rank 0's group in this process, the follower process): the follower echoes each command's
    repr length back (min and max over the ranks), then adds its rows."""
    address = free_address()
    follower = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import torch
        from shared.model.parallel.group import ModelGroup
        from shared.model.parallel.shard import Shard
        group = ModelGroup(Shard(1, 2), {address!r}, torch.device("cpu"))
        while True:
            command = group.receive()
            group.agree_min(len(repr(command)))
            group.agree_min(-len(repr(command)))
            if command[0] == "stop":
                break
        part = torch.full((3, 2, 4), 2.0)
        gathered = group.gather(part, dim=1)
        total = group.sum_rows(torch.tensor([0.1, 1e8, -1e8]))
        group.agree_min(int(gathered.sum().item()))
        for bits in total.view(torch.int32).tolist():  # the follower's sum, bit for bit
            group.agree_min(bits)
            group.agree_min(-bits)
        group.close()
    """)])
    group = ModelGroup(Shard(0, 2), address, torch.device("cpu"), timeout_s=60)
    try:
        yield group, follower
    finally:  # (the test leaves the group itself; a failed one leaves a follower to kill)
        if follower.poll() is None:
            follower.kill()
            follower.wait()
        group.close()


def test_commands_of_every_size_arrive_whole_and_rows_add_in_rank_order(two_ranks):
    group, follower = two_ranks
    for command in COMMANDS:
        group.send(command)
        size = len(repr(command))
        assert group.agree_min(size) == size and -group.agree_min(-size) == size, command[0]
    part = torch.full((3, 2, 4), 1.0)
    gathered = group.gather(part, dim=1)  # [3, 4, 4]: rank 0's two splits, then rank 1's
    assert gathered.shape == (3, 4, 4)
    assert gathered[:, :2].eq(1.0).all() and gathered[:, 2:].eq(2.0).all()
    mine, theirs = torch.tensor([0.2, 1.0, 0.0]), torch.tensor([0.1, 1e8, -1e8])
    total = group.sum_rows(mine)
    assert torch.equal(total, mine + theirs)
    assert group.agree_min(int(gathered.sum().item())) == int(gathered.sum().item())  # the follower's the same
    for bits in total.view(torch.int32).tolist():
        assert group.agree_min(bits) == bits and -group.agree_min(-bits) == bits
    group.close()  # (both leave together)
    assert follower.wait(30) == 0
