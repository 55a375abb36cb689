"""Sizing the KV pool: a setting, or free memory (GPU: leave 1 - fraction of the device free;
CPU: a share of the available RAM), never more than max_sessions x max_context."""

import pytest
import torch

from verifier_service import kv_memory
from verifier_service.kv_memory import KVPlan, plan_kv

GIB = 2**30


def plan(device="cpu", **overrides):
    kwargs = dict(requested_tokens=0, memory_fraction=0.9, block_size=64, bytes_per_token=98304,
                  device=torch.device(device), max_sessions=32, max_context=40960)
    return plan_kv(**(kwargs | overrides))


def test_a_requested_size_wins():
    p = plan(requested_tokens=1000)
    assert (p.num_tokens, p.num_blocks, p.source) == (1000, 15, "kv_cache_tokens")


def test_the_gpu_pool_leaves_the_rest_of_the_device_free(monkeypatch):
    # H200 at 30B-A3B: 141 GiB, 80 GiB free after the weights; 0.9 leaves 14.1 GiB free.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * GIB, 141 * GIB))
    p = plan("cuda")
    expected_bytes = 80 * GIB - 0.1 * 141 * GIB
    assert p.num_tokens % 64 == 0 and p.num_tokens == int(expected_bytes // 98304) // 64 * 64
    assert p.bytes <= expected_bytes and "0.9 of the GPU's 141 GiB" in p.source
    # another process holding most of the device leaves too little: a clear error
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GIB, 141 * GIB))
    with pytest.raises(ValueError, match="no memory left for the KV pool"):
        plan("cuda")


def test_the_cpu_pool_takes_a_share_of_the_ram_and_never_more_than_can_be_used(monkeypatch):
    monkeypatch.setattr(kv_memory, "available_ram", lambda: 20 * GIB)
    p = plan(memory_fraction=0.5)
    assert p.num_tokens == int(10 * GIB // 98304) // 64 * 64
    small = plan(max_sessions=2, max_context=1000)  # two requests of 16 blocks are all that could ever run
    assert small.num_tokens == 2 * 16 * 64 and small.source.startswith("max_sessions x max_context")


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="kv_memory_fraction"):
        plan(memory_fraction=0.0)
    with pytest.raises(ValueError, match="less than one block"):
        KVPlan(num_tokens=10, block_size=64, bytes_per_token=1, source="test")
    assert kv_memory.available_ram() > 0


def test_the_kv_settings_are_validated():
    from verifier_service.settings import VerifierSettings, from_args

    with pytest.raises(ValueError, match="kv_memory_fraction"):
        VerifierSettings(kv_memory_fraction=1.5)
    with pytest.raises(ValueError, match="kv_block_size"):
        VerifierSettings(kv_block_size=0)
    with pytest.raises(ValueError, match="kv_cache_tokens 10 must be 0"):
        VerifierSettings(kv_cache_tokens=10)
    settings = from_args(environ={"TANDEM_VERIFIER_KV_CACHE_TOKENS": "4096", "TANDEM_VERIFIER_KV_BLOCK_SIZE": "16"})
    assert (settings.kv_cache_tokens, settings.kv_block_size) == (4096, 16)
