"""CPU threads of a service's model (shared/threads.py): by default on the CPU a drafter takes one
and a verifier whose drafter is on this host leaves it one core while its requests draft, so
that the two never spin on the same cores; an explicit --cpu-threads wins; a GPU keeps torch's
default."""

import pytest

from shared.threads import ThreadPlan, is_loopback, model_threads


@pytest.mark.parametrize("target,local", [
    ("127.0.0.1:50052", True), ("localhost:50052", True), ("[::1]:50052", True), ("127.0.1.1:9", True),
    ("ipv4:10.0.0.2:1,127.0.0.1:2", True), ("ipv4:10.0.0.2:1,10.0.0.3:2", False),
    ("drafter.svc:50052", False), ("dns:///localhost:50052", False), ("10.1.2.3:50052", False), (None, False), ("", False),
])
def test_loopback_targets(target, local):
    assert is_loopback(target) is local


def test_auto_splits_the_cores_of_a_shared_host_on_the_cpu():
    assert model_threads(0, device="cpu", role="drafter", cores=2) == ThreadPlan(1, 1)
    assert model_threads(0, device="cpu", role="drafter", cores=32) == ThreadPlan(1, 1)
    beside = model_threads(0, device="cpu", role="verifier", drafter="127.0.0.1:50052", cores=2)
    assert beside == ThreadPlan(2, 1) and beside.adapts  # every core until a request drafts
    assert model_threads(0, device="cpu", role="verifier", drafter="localhost:50052", cores=16) == ThreadPlan(16, 15)
    assert model_threads(0, device="cpu", role="verifier", drafter="127.0.0.1:50052", cores=1) == ThreadPlan(1, 1)
    elsewhere = model_threads(0, device="cpu", role="verifier", drafter="drafter.svc:50052", cores=16)
    assert elsewhere == ThreadPlan(None, None) and not elsewhere.adapts  # torch's default: all
    assert model_threads(0, device="cpu", role="verifier", drafter=None, cores=16) == ThreadPlan(None, None)


def test_explicit_threads_win_and_a_gpu_keeps_torch_s_default():
    assert model_threads(3, device="cpu", role="verifier", drafter="127.0.0.1:1", cores=2) == ThreadPlan(3, 3)
    assert model_threads(2, device="cuda", role="drafter") == ThreadPlan(2, 2)
    assert model_threads(0, device="cuda", role="drafter") == ThreadPlan(None, None)
    assert model_threads(0, device="cuda:1", role="verifier", drafter="127.0.0.1:1") == ThreadPlan(None, None)
    with pytest.raises(ValueError, match="cpu_threads"):
        model_threads(-1, device="cpu", role="drafter")
    with pytest.raises(ValueError, match="role"):
        model_threads(0, device="cpu", role="gateway")


def test_a_gpu_named_by_index_becomes_the_model_thread_s_device(monkeypatch):
    import torch

    from shared.threads import use_device

    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    use_device("cpu")
    use_device("cuda")
    use_device("cuda:1")
    assert chosen == [0, 1]


def test_the_native_step_s_threads_are_the_calling_thread_s_own():
    import threading

    from shared.threads import set_step_threads, step_threads

    assert step_threads() is None  # (torch's count until the model thread says otherwise)
    set_step_threads(1)
    seen = []
    other = threading.Thread(target=lambda: seen.append(step_threads()))
    other.start()
    other.join()
    assert step_threads() == 1 and seen == [None]  # (another service's model thread keeps its own)
    set_step_threads(None)
    assert step_threads() is None
    with pytest.raises(ValueError, match="step threads 0"):
        set_step_threads(0)
