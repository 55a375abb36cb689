"""The parts of bench/hybrid_fast.py (the hybrid family on the fused, captured path): shared
helpers, the raw trunk in process, the accuracy comparison, the service from a client."""
