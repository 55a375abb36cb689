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

# case -> (module, kernel, the non-constexpr arguments' types (others i32), constants, options)
CASES = {
    **{f"chain, prefetch {p}": (  # at the default tile (kernels.fused.persistent.DEFAULT_TILE)
        "kernels.fused.persistent_kernels", "chain_kernel", {"table_ptr": "*i64", "counter_ptr": "*i32"},
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, DTYPE="bfloat16", IEEE=False, PREFETCH=p, LINE=64,
             MAX_IN_SPLITS=4, BLOCK_E=128, K_PAD=8), dict(num_warps=8, num_stages=3, launch_cooperative_grid=True))
       for p in (0, 1, 2)},
    **{f"linear, {way}": (
        "kernels.fused.linear_kernels", "linear_kernel",
        {"x_ptr": "*bf16", "w_ptr": "*bf16" if way == "bf16" else "*fp8e4nv", "y_ptr": "*fp32", "s_ptr": "*fp32"},
        dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, IEEE=False, SPLITS=4, PDL=True, FP8=way != "bf16", SBN=128, SBK=128,
             SUB=128, EXACT=way == "fp8 exact", ASM=way == "fp8 exact"), dict(num_stages=4))
        for way in ("bf16", "fp8 dequantised", "fp8 exact")},
    **{f"{name}, {way}": (
        "kernels.fused.moe_kernels", name,
        {"ids_ptr": "*i64", "sorted_ptr": "*i32", "tile_len_ptr": "*i32", "w_ptr": "*bf16" if way == "bf16" else "*fp8e4nv",
         "s_ptr": "*fp32", "x_ptr": "*bf16", "act_ptr": "*bf16", "out_ptr": "*fp32"},
        dict(R_PAD=16, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, IEEE=False, PDL=True, TABLE=True, FP8=way != "bf16",
             SBN=128, SBK=128, SUB=128, EXACT=way != "bf16", ASM=way != "bf16",
             **(dict(TOP_K=8) if name == "gate_up_kernel" else dict(PRELOAD=True))), dict(num_stages=3))
        for name in ("gate_up_kernel", "down_kernel") for way in ("bf16", "fp8 exact")},
}


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
        kernel = getattr(importlib.import_module(module), name)
        constants = {k: getattr(tl, v) if k == "DTYPE" else v for k, v in constants.items()}
        signature = {p.name: "constexpr" if p.is_constexpr else types.get(p.name, "i32") for p in kernel.params}
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
            results[case] = {"ptx": ptx, "spill_stores": int(spills.group(1)) if spills else 0}
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


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_the_persistent_chain_compiles_with_its_barrier_and_prefetch(compiled, prefetch):
    ptx = ptx_of(compiled, f"chain, prefetch {prefetch}")
    # one thread a program arrives (release) and polls (acquire): the barrier counts programs
    assert ptx.count("atom.global.gpu.release.add") == 1 and "ld.global.gpu.acquire" in ptx
    assert ("prefetch.global.L2" in ptx) == (prefetch > 0)
    assert "cp.async" in ptx  # the weight loads pipelined
    # one kernel holds every stage's code: a tile that leaves it too few registers spills in every loop
    assert compiled[f"chain, prefetch {prefetch}"]["spill_stores"] < 1024


@pytest.mark.parametrize("way", ["bf16", "fp8 dequantised", "fp8 exact"])
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
