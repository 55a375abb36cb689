"""The kernels whose code the interpreter cannot check compile for the H200 (sm_90) on a CPU.

The interpreter runs a kernel's Python, not what the GPU compiler accepts: inline PTX (the FP8
bit moves, the L2 prefetch), cooperative launches, globals a jit function may not read, the
pipeliner's shared-memory needs. Triton's own compiler (its frontend, passes and the ptxas it
ships) compiles for a GPU target without one, so each such kernel is compiled here for sm_90 in
the ways the service launches it — in a process of its own, since this suite's processes run
Triton's interpreter. This is no substitute for running them on the GPU (the GPU machine runs
tests/kernels/fused whole), only the check a CPU can make.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

# case -> (module, kernel (an expression in it), the arguments' Triton types where not the default
# (pointers *bf16, FLOATS fp32, other scalars i32), constants, options)
CASES = {
    **{f"chain, prefetch {p}{', fp8' if fp8 else ''}": (  # at the default tile (persistent.DEFAULT_TILE)
        "kernels.fused.persistent_kernels", "chain_kernel", {"table_ptr": "*i64", "counter_ptr": "*i32"},
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, DTYPE="bfloat16", IEEE=False, PREFETCH=p, LINE=64,
             MAX_IN_SPLITS=4, BLOCK_E=128, K_PAD=8, HAS_FP8=fp8, SBN=128, SBK=128, SUB=128, DENSE_EXACT=False,
             EXPERT_EXACT=True, ASM=True), dict(num_warps=8, num_stages=3, launch_cooperative_grid=True))
       for p in (0, 1, 2) for fp8 in (False, True)},
    # the projections at the tiles the service launches (kernels.fused.linear: linear_config, MEASURED,
    # weight_config for FP8; o_proj in its K splits)
    **{f"linear, {way}": (
        "kernels.fused.linear_kernels", "linear_kernel",
        {"x_ptr": "*bf16", "w_ptr": "*bf16" if way.startswith("bf16") else "*fp8e4nv",
         "y_ptr": "*fp32" if splits > 1 else "*bf16", "s_ptr": "*fp32"},
        dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=False, SPLITS=splits, PDL=True,
             FP8=not way.startswith("bf16"), SBN=128, SBK=128, SUB=min(block_k, 128), EXACT=way == "fp8 exact",
             ASM=way == "fp8 exact"), dict(num_warps=warps, num_stages=stages))
        for way, (block_n, block_k, warps, stages), splits in (
            ("bf16", (64, 256, 4, 4), 1), ("bf16, split", (64, 256, 4, 4), 4), ("bf16, measured 128 x 256", (128, 256, 4, 3), 1),
            ("bf16, measured 128 x 128", (128, 128, 8, 4), 1), ("fp8 dequantised", (32, 512, 4, 4), 1),
            ("fp8 dequantised, split", (32, 512, 4, 4), 4), ("fp8 exact", (32, 128, 4, 4), 1))},
    **{f"{name}, {way}": (
        "kernels.fused.moe_kernels", name,
        {"ids_ptr": "*i64", "sorted_ptr": "*i32", "tile_len_ptr": "*i32", "w_ptr": "*bf16" if way == "bf16" else "*fp8e4nv",
         "s_ptr": "*fp32", "x_ptr": "*bf16", "act_ptr": "*bf16", "out_ptr": "*fp32"},
        dict(R_PAD=16, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, IEEE=False, PDL=True, TABLE=True, FP8=way != "bf16",
             SBN=128, SBK=128, SUB=128, EXACT=way != "bf16", ASM=way != "bf16",
             **(dict(TOP_K=8) if name == "gate_up_kernel" else dict(PRELOAD=True))), dict(num_stages=3))
        for name in ("gate_up_kernel", "down_kernel") for way in ("bf16", "fp8 exact")},
    # the other kernels of the step (and the FP8 bit moves alone), as their launch sites launch them
    "add_rmsnorm": ("kernels.fused.norm", "_kernels()[0]", {"x_ptr": "*fp32"},
                    dict(HAS_RESIDUAL=True, BLOCK=2048, PARTIALS=4, PDL=True, EARLY=True, CENTRED=True), {}),
    "qk_norm_rope": ("kernels.fused.norm", "_kernels()[1]",
                     {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i32", "table_ptr": "*i32"},
                     dict(NUM_Q=32, NUM_KV=4, D=128, HALF=32, BLOCK_SIZE=16, PDL=True, EARLY=True, CENTRED=True,
                          ROT=64, Q_STRIDE=256), {}),
    "attention split": ("kernels.fused.attention_kernels", "split_kernel",
                        {"table_ptr": "*i32", "pos_ptr": "*i64", "seq_start_ptr": "*i32", "seq_slot_ptr": "*i32",
                         "o_part_ptr": "*fp32", "lse_part_ptr": "*fp32"},
                        dict(NUM_Q=32, NUM_KV=4, D=128, GROUP=8, ROWS_PER_BLOCK=2, SPLIT=128, BLOCK_SIZE=16, TILES=2,
                             BLOCK_M=16, BLOCK_N=64, IEEE=False, PDL=True), dict(num_stages=3)),
    "attention merge": ("kernels.fused.attention_kernels", "merge_kernel",
                        {"o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "pos_ptr": "*i64"},
                        dict(NUM_Q=32, D=128, SPLIT=128, CHUNK=32, SLICE=64, PDL=True, EARLY=True, HAS_GATE=True),
                        dict(num_warps=1)),
    **{f"router top-k, {way}": (
        "kernels.fused.router", "_kernels()",
        {"logits_ptr": "*fp32", "ids_ptr": "*i64", "weights_ptr": "*fp32", "resident_ptr": "*i8", "draft_ptr": "*i8",
         "other_mult_ptr": "*fp32", "draft_mult_ptr": "*fp32", "live_ptr": "*i32"},
        dict(TOP_K=8, K_PAD=8, BLOCK_E=256, NORMALIZE=True, MOCE=way == "moce", PARTIALS=4, ROUND_TO="bfloat16",
             HAS_LIVE=True, PDL=True, SHARED=True, OUT_K=9, MAX_WITH_INDEX=True), {}) for way in ("plain", "moce")},
    "router top-k, 512 experts": (
        "kernels.fused.router", "_kernels()",
        {"logits_ptr": "*fp32", "ids_ptr": "*i64", "weights_ptr": "*fp32", "resident_ptr": "*i8", "draft_ptr": "*i8",
         "other_mult_ptr": "*fp32", "draft_mult_ptr": "*fp32", "live_ptr": "*i32"},
        dict(TOP_K=10, K_PAD=16, BLOCK_E=512, NORMALIZE=True, MOCE=False, PARTIALS=8, ROUND_TO="bfloat16",
             HAS_LIVE=True, PDL=True, SHARED=True, OUT_K=11, MAX_WITH_INDEX=True), dict(num_warps=4)),
    "route table": ("kernels.fused.moe_kernels", "route_table_kernel", {"ids_ptr": "*i64", "sorted_ptr": "*i32",
                                                                         "tile_len_ptr": "*i32"},
                    dict(R_PAD=128, CHUNK=16, BLOCK_M=16, PDL=True), {}),
    "combine": ("kernels.fused.moe_kernels", "combine_kernel",
                {"route_ptr": "*fp32", "weights_ptr": "*fp32", "rows_ptr": "*i64"},
                dict(TOP_K=9, K_PAD=16, BLOCK=2048, HAS_ROWS=True, PDL=True, EARLY=True, CENTRED=True),
                dict(num_warps=8)),
    "gated delta": ("kernels.fused.deltanet_kernels", "gated_delta_kernel",
                    {"a_log_ptr": "*fp32", "dt_bias_ptr": "*bf16", "rec_ptr": "*fp32", "starts_ptr": "*i32",
                     "in_ptr": "*i32", "dst_ptr": "*i32", "kept_rec_ptr": "*fp32", "arrivals_ptr": "*i32"},
                    dict(HK=16, HV=32, DK=128, DV=128, BLOCK_K=128, BLOCK_V=64, V_SPLITS=2, KEEP_CONV=True,
                         KEEP_REC=True, PDL=True, EARLY=True), dict(num_warps=4)),
    "e4m3 bit moves": ("kernels.fused.fp8_kernels", "exact_bf16_kernel", {"q_ptr": "*fp8e4nv"}, dict(BLOCK=1024), {}),
}
FLOATS = {"eps", "sm_scale", "floor", "q_scale", "qk_eps"}  # scalar arguments of type float
H200_SHARED_MEMORY = 232448  # bytes a block may take (227 KiB): more, and the launch fails


def compile_all() -> dict[str, dict]:
    """Each case compiled for sm_90: {case: {"ptx": ...} or {"error": ...}} (run without the interpreter)."""
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from triton.backends.nvidia.compiler import get_ptxas

    results = {}
    for case, (module, name, types, constants, options) in CASES.items():
        kernel = eval(name, vars(importlib.import_module(module)))  # (a closure's kernels: "_kernels()[0]")
        constants = {k: getattr(tl, v) if k in ("DTYPE", "ROUND_TO") else v for k, v in constants.items()}
        signature = {p.name: "constexpr" if p.is_constexpr else types.get(
            p.name, "*bf16" if p.name.endswith("_ptr") else "fp32" if p.name in FLOATS else "i32") for p in kernel.params}
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                                      target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **options})
            ptx = compiled.asm["ptx"]
            with tempfile.TemporaryDirectory() as folder:  # ptxas -v: the registers and spills a thread
                path = os.path.join(folder, "kernel.ptx")
                with open(path, "w") as file:
                    file.write(ptx)
                report = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", path, "-o", path + ".o"],
                                        capture_output=True, text=True, check=True).stderr
            spills = re.search(r"(\d+) bytes spill stores", report)
            results[case] = {"ptx": ptx, "spill_stores": int(spills.group(1)) if spills else 0,
                             "shared": compiled.metadata.shared}
        except Exception as error:  # (reported per case by the tests)
            results[case] = {"error": f"{type(error).__name__}: {error}"}
    return results


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def ptx_of(compiled: dict, case: str) -> str:
    assert "error" not in compiled[case], compiled[case]["error"][:3000]
    return compiled[case]["ptx"]


@pytest.mark.parametrize("fp8", ["", ", fp8"])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_the_persistent_chain_compiles_with_its_barrier_and_prefetch(compiled, prefetch, fp8):
    case = f"chain, prefetch {prefetch}{fp8}"
    ptx = ptx_of(compiled, case)
    # one thread a program arrives (release) and polls (acquire): the barrier counts programs
    assert ptx.count("atom.global.gpu.release.add") == 1 and "ld.global.gpu.acquire" in ptx
    assert ("prefetch.global.L2" in ptx) == (prefetch > 0)
    assert "cp.async" in ptx  # the weight loads pipelined
    assert ("prmt.b32" in ptx) == bool(fp8)  # the experts' FP8 tiles by bit moves
    # one kernel holds every stage's code: a tile that leaves it too few registers spills in every loop
    assert compiled[case]["spill_stores"] < 1024, compiled[case]["spill_stores"]
    assert compiled[case]["shared"] <= H200_SHARED_MEMORY


def test_every_kernel_fits_the_h200s_shared_memory(compiled):
    over = {case: result["shared"] for case, result in compiled.items() if result.get("shared", 0) > H200_SHARED_MEMORY}
    assert not over, over


@pytest.mark.parametrize("way", ["bf16", "bf16, split", "bf16, measured 128 x 256", "bf16, measured 128 x 128",
                                 "fp8 dequantised", "fp8 dequantised, split", "fp8 exact"])
def test_the_projection_kernel_compiles_in_every_way(compiled, way):
    ptx = ptx_of(compiled, f"linear, {way}")
    assert ("prmt.b32" in ptx) == (way == "fp8 exact")  # the e4m3 bit moves (fp8_kernels.e4m3_as_bf16)


@pytest.mark.parametrize("way", ["bf16", "fp8 exact"])
@pytest.mark.parametrize("name", ["gate_up_kernel", "down_kernel"])
def test_the_expert_kernels_compile(compiled, name, way):
    ptx = ptx_of(compiled, f"{name}, {way}")
    assert ("prmt.b32" in ptx) == (way == "fp8 exact")


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    print(json.dumps(compile_all()))


@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith(("chain", "linear", "gate_up", "down_kernel"))])
def test_every_other_kernel_of_the_step_compiles(compiled, case):
    ptx = ptx_of(compiled, case)
    assert (case == "e4m3 bit moves") <= ("prmt.b32" in ptx)
    assert ("griddepcontrol.wait" in ptx) == (case != "e4m3 bit moves")  # PDL where launched as a dependent
