"""Adopt what a config_sweep.py run measured better: per weight, the linear-kernel variant with the
lowest mean ratio under --threshold, written into kernels/fused/linear.py's MEASURED table (of
the tree it runs in), so that a service started afterwards runs with it (bench/hybrid_fast.py
--part service then measures what a user gets; run it beside the tree before for a pairing).

    python bench/sweep_pick.py --table sweep.md --weight "linear in_proj=12352x2048" [--weight ...] [--apply]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

LINEAR = Path(__file__).resolve().parent.parent / "kernels" / "fused" / "linear.py"
ROW = re.compile(r"^\| (?P<name>[^|]+?): BN (?P<bn>\d+) BK (?P<bk>\d+) warps (?P<w>\d+) stages (?P<s>\d+) \|(?P<ratios>.*)\|\s*$")


def best(table: str, name: str, threshold: float) -> tuple[tuple[int, int, int, int], float] | None:
    """(config, mean ratio) of the best variant of weight `name` under threshold, or None."""
    found = None
    for line in table.splitlines():
        match = ROW.match(line)
        if not match or match["name"] != name:
            continue
        ratios = [float(r) for r in match["ratios"].split("|") if r.strip()]
        mean = ratios[-1]  # the table's last column is the mean
        config = (int(match["bn"]), int(match["bk"]), int(match["w"]), int(match["s"]))
        if mean < threshold and (found is None or mean < found[1]):
            found = (config, mean)
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--table", type=Path, required=True)
    parser.add_argument("--weight", action="append", required=True, help='"NAME=NOUTxNIN", NAME as the sweep prints it')
    parser.add_argument("--threshold", type=float, default=0.99)
    parser.add_argument("--apply", action="store_true", help="write the picks into kernels/fused/linear.py's MEASURED")
    args = parser.parse_args()
    table = args.table.read_text()
    picks = {}
    for weight in args.weight:
        name, shape = weight.split("=")
        num_out, num_in = (int(v) for v in shape.split("x"))
        found = best(table, name, args.threshold)
        print(f"{name} [{num_out}, {num_in}]: " + (f"{found[0]} (mean ratio {found[1]:.3f})" if found else "keep the rule"))
        if found:
            picks[(num_out, num_in)] = found[0]
    if args.apply and picks:
        source = LINEAR.read_text()
        line = "MEASURED: dict[tuple[int, int], tuple[int, int, int, int]] = {}"
        if line not in source:
            raise SystemExit(f"{LINEAR} has no empty MEASURED table to fill")
        LINEAR.write_text(source.replace(line, f"MEASURED: dict[tuple[int, int], tuple[int, int, int, int]] = {picks!r}"))
        print(f"wrote {picks} into {LINEAR}")


if __name__ == "__main__":
    main()
