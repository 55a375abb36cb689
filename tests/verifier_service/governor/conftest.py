"""What the governor's tests share: settings, a scripted clock, two drafters' costs."""

from __future__ import annotations

from verifier_service.governor import Governor, GovernorSettings, Load

ALONE = Load.ALONE

# (plain rechecks have tests of their own: here they never come)
SETTINGS = GovernorSettings(judge_rounds=5, min_hold=4, probe_share=0.05, window=8, server_window=8, recheck_rounds=10**6)


def run(governor: Governor, rounds: int, cost, clock: list[float] | None = None, load: Load = ALONE) -> list[bool]:
    """Drive `rounds` rounds under `load`; cost(speculative) -> (seconds, tokens). Returns each round's kind."""
    clock = clock if clock is not None else [0.0]
    kinds = []
    for _ in range(rounds):
        speculative = governor.begin(clock[0], load)
        seconds, tokens = cost(speculative)
        clock[0] += seconds
        governor.end(tokens)
        kinds.append(speculative)
    return kinds


def slow_drafter(speculative: bool) -> tuple[float, int]:
    # 3 tokens in 40 ms with drafts (13.3 ms/token) against 1 token in 5 ms without
    return (0.040, 3) if speculative else (0.005, 1)


def fast_drafter(speculative: bool) -> tuple[float, int]:
    return (0.008, 3) if speculative else (0.005, 1)  # 2.7 ms/token against 5


def runs(kinds: list[bool]) -> list[tuple[bool, int]]:
    """Run-length encoding of the round kinds."""
    out: list[tuple[bool, int]] = []
    for kind in kinds:
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + 1)
        else:
            out.append((kind, 1))
    return out


def round_robin(governors: list[Governor], rounds: int, cost, load: Load = ALONE) -> list[list[bool]]:
    """Requests running together: one round of each in turn, each on its own clock."""
    clocks = [[0.0] for _ in governors]
    kinds: list[list[bool]] = [[] for _ in governors]
    for _ in range(rounds):
        for governor, clock, seen in zip(governors, clocks, kinds):
            seen.extend(run(governor, 1, cost, clock, load))
    return kinds
