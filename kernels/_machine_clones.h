/* MACHINE_CLONES: a function compiled twice on x86-64 (GCC, glibc: an ifunc), for AVX2 + FMA and
   for the baseline; the loader picks one for the machine, so every call of a process takes the
   same one (a row's bits stay its own within a process). Elsewhere: compiled once. Shared by the
   native CPU kernels (kernels/fused/_cpu_rows.c, kernels/_sampling_rows.c). */
#ifndef TANDEM_MACHINE_CLONES_H
#define TANDEM_MACHINE_CLONES_H
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__GLIBC__)
#define MACHINE_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define MACHINE_CLONES
#endif
#endif
