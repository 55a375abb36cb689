"""How many CPU threads a service's model runs torch ops on (`--cpu-threads`), and the CPU's
native step (kernels.fused.cpu_step; its count: `step_threads`).

On the CPU a drafter and a verifier on one host share its cores, and torch's threads wait
for each other by spinning: two processes of as many threads as there are cores, both
computing, slow each other several-fold (docs/PERFORMANCE.md, session 22: a verifier step of 8
rows took 5.5× as long beside a busy two-thread process on two cores, 1.2× beside one of a
single thread). So by default (0, auto) on the CPU a drafter takes one thread — its MTP layer
and suffix lookups are light — and a verifier whose drafter runs on this host (a loopback
address) takes every core while none of its requests speculates (the drafter then idles) and
leaves the drafter one core while any does (the engine loop says when: EngineLoop's
on_drafting). A verifier whose drafter is elsewhere takes all of them, as torch does. On a GPU
torch's default stands (the host threads only launch work).

Only the native step follows a drafter's work (`set_step_threads`): its rows' bits do not depend
on its threads (DESIGN §11). torch's own ops keep the model's one count: on some machines their
sums follow the thread count (torch 2.13's CPU build on AMD Zen 5: a prompt prefilled on one
thread and on two differ in low bits), and a request's tokens may not depend on whether another
request was drafting while it ran (exact mode, DESIGN §2).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


def available_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's CPU set)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        return os.cpu_count() or 1


def is_loopback(target: str | None) -> bool:
    """Whether a gRPC target (host:port, ipv4:a:p,b:p, dns:///name:port) names this host."""
    if not target:
        return False
    hosts = []
    if target.startswith(("ipv4:", "ipv6:")):
        hosts = [address.rpartition(":")[0] for address in target.split(":", 1)[1].split(",")]
    elif "://" not in target:
        hosts = [target.rpartition(":")[0]]
    return any(host in LOOPBACK_HOSTS or host.startswith("127.") for host in hosts)


@dataclass(frozen=True)
class ThreadPlan:
    """The model thread's torch threads: `full` while no request drafts, `drafting` while some
    do (None: torch's default, untouched)."""

    full: int | None
    drafting: int | None

    @property
    def adapts(self) -> bool:
        return self.full != self.drafting


def model_threads(requested: int, *, device: str, role: str, drafter: str | None = None,
                  cores: int | None = None) -> ThreadPlan:
    """requested: --cpu-threads (0 = auto); role: "drafter" or "verifier" (with its drafter's
    address)."""
    if requested < 0:
        raise ValueError(f"cpu_threads {requested} must be >= 0")
    if role not in ("drafter", "verifier"):
        raise ValueError(f"role {role!r} must be drafter or verifier")
    if requested:
        return ThreadPlan(requested, requested)
    if device != "cpu":
        return ThreadPlan(None, None)
    if role == "drafter":
        return ThreadPlan(1, 1)
    if not is_loopback(drafter):
        return ThreadPlan(None, None)
    cores = cores or available_cores()
    return ThreadPlan(cores, max(cores - 1, 1))


def use_threads(num_threads: int) -> None:
    """Run on the model's thread: its torch ops take `num_threads` threads. (torch gives a thread
    its count at the thread's first op, from the value last set anywhere in the process: taken
    now, so that a later setting elsewhere — another service in the same process — cannot
    replace it.)"""
    import torch

    torch.set_num_threads(num_threads)
    if torch.get_num_threads() != num_threads:  # (the get is the first op: the count is this thread's now)
        raise RuntimeError(f"torch runs {torch.get_num_threads()} threads, not {num_threads}")


def use_device(device: str) -> None:
    """Run on the model's thread: a GPU named by index (`cuda:1`) becomes the thread's current
    device, so the streams, events, graphs and kernel launches made without naming a device land
    on the model's GPU (a drafter on a GPU of its own beside a verifier on cuda:0). Nothing on
    the CPU."""
    import torch

    target = torch.device(device)
    if target.type == "cuda":
        torch.cuda.set_device(target.index or 0)


_step = threading.local()


def set_step_threads(count: int | None) -> None:
    """Run on the model's thread: its native steps take `count` threads from now on (None:
    torch's count)."""
    if count is not None and count < 1:
        raise ValueError(f"step threads {count} must be >= 1")
    _step.count = count


def step_threads() -> int | None:
    """The calling thread's native-step threads (None: torch's count)."""
    return getattr(_step, "count", None)
