"""`--part accuracy` of bench/hybrid_fast.py: the fused and the reference paths each against the
float32 reference, on models of one linear-attention layer, one full-attention layer and four."""

from __future__ import annotations

import gc
from dataclasses import replace

import torch
from hybridbench.common import DEVICE, SMALL, elapsed, rel_err
from pairbench.common import QWEN3_5_35B_A3B, log

def run_accuracy(args) -> list[dict]:
    import copy

    from shared.model.families import build_fused
    from shared.model.rows import Rows
    from shared.model.kv_cache import KVPool
    from shared.model.families.hybrid.loader import random_next
    from shared.model.families.hybrid.config import NextConfig

    out = []
    for name, types in (("1 linear-attention layer", ["linear_attention"]), ("1 full-attention layer", ["full_attention"]),
                        ("4 layers", QWEN3_5_35B_A3B["layer_types"][:4])):
        shapes = QWEN3_5_35B_A3B | (SMALL if args.small else {}) | dict(num_hidden_layers=len(types), layer_types=types,
                                                                       max_position_embeddings=1024)
        config = replace(NextConfig.from_dict(shapes), mtp_num_hidden_layers=0)
        low = random_next(config, dtype=torch.bfloat16, device=DEVICE, parts="trunk")
        high = copy.deepcopy(low).float()
        ids = torch.randint(0, config.vocab_size, (517,), generator=torch.Generator().manual_seed(1)).to(DEVICE)

        def reference(model):
            cache = model.new_cache(540)
            model.prefill(ids[:512], cache)
            return model(ids[512:], cache, keep_states=True)[0].float()

        truth, ref = reference(high), reference(low)
        del high
        fused = build_fused(low, max_rows=8, max_length=1024, num_state_slots=1)
        pool = KVPool(num_layers=low.num_kv_layers, num_slots=1, max_length=1024, num_kv_heads=config.num_key_value_heads,
                      head_dim=config.head_dim, dtype=torch.bfloat16, device=DEVICE, block_size=64)
        slot, _ = pool.acquire(540)
        if fused.states is not None:
            fused.states.reset(slot)
        fused.prefill(ids[:512], [(0, 512, slot)], pool.paged())
        read, write = fused.states.buffers(slot) if fused.states is not None else (0, 0)
        rows = Rows.window(512, 5, slot, DEVICE)
        rows = Rows(**{**rows.__dict__, "state_in": torch.tensor([read], device=DEVICE),
                       "state_out": torch.tensor([write], device=DEVICE)})
        logits = fused.forward(ids[512:], rows, pool.paged())[0].float()
        out.append(dict(model=name, fused_vs_float32=rel_err(logits, truth), reference_vs_float32=rel_err(ref, truth),
                        fused_vs_reference=rel_err(logits, ref)))
        log(f"  [{elapsed():.0f}s] {out[-1]}")
        del low, fused, pool
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return out
