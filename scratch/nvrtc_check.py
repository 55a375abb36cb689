"""Compile a .cu with the pip wheel's NVRTC for sm_90a; print the log (ptxas -v)."""
import ctypes, sys, glob
lib = ctypes.CDLL(glob.glob('/work/main/.venv/lib/python3.11/site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.12')[0])
src = open(sys.argv[1]).read().encode()
prog = ctypes.c_void_p()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"k.cu", 0, None, None) == 0
opts = [b"--gpu-architecture=sm_90a", b"--ptxas-options=-v", b"-lineinfo"] + [a.encode() for a in sys.argv[2:]]
arr = (ctypes.c_char_p * len(opts))(*opts)
res = lib.nvrtcCompileProgram(prog, len(opts), arr)
size = ctypes.c_size_t(); lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
log = ctypes.create_string_buffer(size.value); lib.nvrtcGetProgramLog(prog, log)
print(log.value.decode())
print("result", res)
if res == 0:
    n = ctypes.c_size_t(); lib.nvrtcGetCUBINSize(prog, ctypes.byref(n)); print("cubin bytes", n.value)
