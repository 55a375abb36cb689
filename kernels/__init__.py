"""Pure math on torch tensors: random draws, sampling, verification, retention, routing, MoE.

Nothing in this package does I/O, logging, networking or telemetry, so every function is
unit-testable on the CPU and callable from any service or benchmark.
"""
