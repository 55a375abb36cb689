"""The pieces of bench/pair_speedup.py (its docstring describes the method).

  common    constants (setups, prompts, model shapes), small helpers, ServiceError
  services  the child services (start, health waits, stop) and the byte-counting tap
  costs     drafter cost per round: tap bytes, in-process replay timing, replay-drafter stats
  runs      the arms, requests and interleaved paired blocks
  report    paired-ratio analysis and the markdown tables
  setups    the embedded and synthetic setups end to end
  load      bench/serve_load.py's loop of requests against one verifier and what each arm reads

Importing the package puts the repository (and, when `tandem.v1` is not installed, the
generated protocol modules beside their .proto sources) on sys.path, before any module
here imports `shared` or `tandem`.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
try:
    import tandem.v1  # noqa: F401  (the generated protocol modules)
    EXTRA_PATHS: list[str] = []
except ImportError:  # not installed: the generated modules beside their .proto sources
    sys.path.insert(0, str(REPO / "protos"))
    EXTRA_PATHS = [str(REPO / "protos")]
