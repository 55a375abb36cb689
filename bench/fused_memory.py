"""What building a fused forward leaves on the GPU: allocated and reserved memory, the driver's
free figure, and the KV pool the verifier would plan from it.

Random bf16 weights at --shapes (default Qwen3.5-35B-A3B), on one GPU. Prints four lines:
after the weights load, after the fused forward is built, the KV plan (`plan_kv` at
--kv-memory-fraction, no session limit) and after `torch.cuda.empty_cache()`. Reserved well
above allocated after the build means old weight layouts stay in the caching allocator, out of
the KV pool's and a co-located drafter's reach.

    python bench/fused_memory.py [--shapes qwen3.5-35b-a3b] [--kv-memory-fraction 0.9]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pairbench.common import SHAPES  # noqa: E402  (puts the repo on sys.path)

from shared.model import load_model  # noqa: E402
from shared.model.families import build_fused, family_for  # noqa: E402
from shared.model.kv_cache import KVPool  # noqa: E402
from verifier_service.kv_memory import plan_kv  # noqa: E402

GIB = 2**30


def show(what: str) -> None:
    free, total = torch.cuda.mem_get_info()
    print(f"{what}: allocated {torch.cuda.memory_allocated() / GIB:.1f} GiB, reserved "
          f"{torch.cuda.memory_reserved() / GIB:.1f} GiB, driver free {free / GIB:.1f} of {total / GIB:.1f} GiB",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="qwen3.5-35b-a3b")
    parser.add_argument("--kv-memory-fraction", type=float, default=0.9)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fused_memory.py measures the CUDA caching allocator: it needs a GPU")
    shapes = SHAPES[args.shapes] | dict(max_position_embeddings=4096)
    config = family_for(shapes["model_type"]).config_class().from_dict(shapes)
    started = time.perf_counter()
    model = load_model(config=config, random_weights=True, dtype=torch.bfloat16, device="cuda", seed=0)
    show(f"weights loaded ({time.perf_counter() - started:.0f} s)")
    build_fused(model, max_rows=17, max_length=4096, num_state_slots=9)
    show("fused forward built")
    c = model.config
    bytes_per_token = KVPool.bytes_per_token(num_layers=model.num_kv_layers, num_kv_heads=c.num_key_value_heads,
                                             head_dim=c.head_dim, dtype=model.dtype)
    plan = plan_kv(requested_tokens=0, memory_fraction=args.kv_memory_fraction, block_size=64,
                   bytes_per_token=bytes_per_token, device=torch.device("cuda"), max_sessions=10**6, max_context=4096)
    print(plan.describe())
    torch.cuda.empty_cache()
    show("after empty_cache")


if __name__ == "__main__":
    main()
