"""Build hooks: generate the protobuf/gRPC Python modules from protos/ at build time, and
compile the suffix indexes' native part (drafter_service/proposers/_context_table.c: the global
index's table; _suffix_walk.c: the proposal walk over either index; _request_counts.c: a
request's own counting) and the CPU's row-invariant step kernels (kernels/fused/_cpu_rows.c).

The generated `*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py` files and the compiled extension
are git-ignored; both a regular install and an editable install (`pip install -e .`) build
them. Without installing: `python setup.py build_ext --inplace` builds the extension alone.
"""

from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "protos"


def generate_protos() -> None:
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    sources = sorted(PROTO_ROOT.glob("tandem/v1/*.proto"))
    if not sources:
        raise RuntimeError(f"no .proto files under {PROTO_ROOT}")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={PROTO_ROOT}",
        f"--pyi_out={PROTO_ROOT}",
        f"--grpc_python_out={PROTO_ROOT}",
        *(str(s.relative_to(PROTO_ROOT)) for s in sources),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        generate_protos()
        super().run()


# C99 with GNU builtins (gcc or clang); the module has no dependency but Python's headers.
CONTEXT_TABLE = Extension("drafter_service.proposers._context_table",
                          sources=[f"drafter_service/proposers/{name}.c" for name in ("_context_table", "_suffix_walk",
                                                                                      "_request_counts")],
                          depends=["drafter_service/proposers/_context_table.h"], libraries=["m"],
                          extra_compile_args=["-std=gnu11"])

# The CPU's row-invariant step kernels (kernels/fused/cpu_rows.py) and the step as one call
# (kernels/fused/cpu_step.py); likewise C99, no dependency.
# (-Wno-psabi: its 32-byte vector type is passed between inlined functions only. -fno-trapping-math:
# no FP exception flags are read, so the softmax's selects may be vectorised; no result changes.
# -ffp-contract=off: a multiply, then an add, wherever the code says so — no fused multiply-add the
# compiler picks. GCC's default (fast) contracts where its passes find a product beside a sum, and
# GCC 13.3 found them differently in the 8-lane, paired and wide kernels: on the GPU machine's Xeon
# a row's product differed by how many rows shared the call. Off, the bits follow the code alone:
# the same on every clone, machine and compiler.)
CPU_ROWS = Extension("kernels.fused._cpu_rows", sources=["kernels/fused/_cpu_rows.c", "kernels/fused/_cpu_step.c",
                                                        "kernels/fused/_cpu_wide.c", "kernels/fused/_cpu_draws.c"],
                     libraries=["m"], depends=["kernels/_machine_clones.h", "kernels/fused/_cpu_rows.h",
                                               "kernels/_sampling_core.h"],
                     extra_compile_args=["-std=gnu11", "-O3", "-Wno-psabi", "-fno-trapping-math", "-ffp-contract=off"])

# The processed distribution of sampled rows on the CPU (kernels/sampling.py); likewise.
# (-fno-trapping-math: no FP exception flags are read, so the normaliser's selects may be
# vectorised; no result changes, unlike -ffast-math's reassociation. -ffp-contract=off: its
# arithmetic (kernels/_sampling_core.h) is also the step's draws' (_cpu_draws.c, in the module
# above): compiled alike, the two give the same bits.)
SAMPLING_ROWS = Extension("kernels._sampling_rows", sources=["kernels/_sampling_rows.c"], libraries=["m"],
                          depends=["kernels/_machine_clones.h", "kernels/_sampling_core.h"],
                          extra_compile_args=["-std=gnu11", "-O3", "-fno-trapping-math", "-ffp-contract=off"])

setup(cmdclass={"build_py": BuildPyWithProtos}, ext_modules=[CONTEXT_TABLE, CPU_ROWS, SAMPLING_ROWS])
