"""Run-wide helpers: the run clock, timestamped logging and JSON files.

Import this module before numpy/torch: T0 is taken at its first import, so the times that log() prints
and the --total-minutes deadline in train.train() count the heavy imports.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

T0 = time.time()  # before the heavy imports: --total-minutes counts them


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
