"""Analysis of the paired blocks (ratios, acceptance, cost curve, ideal) and the markdown report."""

from __future__ import annotations

import statistics
import time

from .common import fmt, mean, median
from .runs import Arm


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank) of values, None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def decode_tps(records: list[dict]) -> float | None:
    """Tokens/s from each request's first tokens on (its prompt's prefill left out: the same work in
    both arms, which the verify-only ideal leaves out too); None without first-token times."""
    if any(r.get("first_s") is None for r in records):
        return None
    seconds = sum(r["wall_s"] - r["first_s"] for r in records)
    return sum(r["tokens"] - r["first_tokens"] for r in records) / seconds if seconds > 0 else None


def block_ratios(records: list[dict], spec: Arm, plain: Arm, blocks: int) -> list[dict]:
    rows = []
    for block in range(blocks):
        s = [r for r in records if r["block"] == block and r["arm"] == spec.name]
        p = [r for r in records if r["block"] == block and r["arm"] == plain.name]
        if not s or not p:
            continue
        s_tps = sum(r["tokens"] for r in s) / sum(r["wall_s"] for r in s)
        p_tps = sum(r["tokens"] for r in p) / sum(r["wall_s"] for r in p)

        def server_tps(rs):
            seconds = sum(r["stats"]["completion_tokens"] / r["stats"]["tokens_per_s"] for r in rs if r["stats"]["tokens_per_s"])
            return sum(r["stats"]["completion_tokens"] for r in rs) / seconds if seconds else None

        ss, ps = server_tps(s), server_tps(p)
        s_dec, p_dec = decode_tps(s), decode_tps(p)
        rows.append({
            "block": block, "spec_first": s[0]["position"] < p[0]["position"], "spec_tps": s_tps, "plain_tps": p_tps,
            "ratio": s_tps / p_tps, "server_ratio": ss / ps if ss and ps else None,
            "decode_ratio": s_dec / p_dec if s_dec and p_dec else None,
        })
    return rows


def analyse(records: list[dict], spec: Arm, plain: Arm, blocks: int, k_max: int) -> dict:
    s_recs = [r for r in records if r["arm"] == spec.name]
    p_recs = [r for r in records if r["arm"] == plain.name]
    per_block = block_ratios(records, spec, plain, blocks)
    ratios = [row["ratio"] for row in per_block]
    server_ratios = [row["server_ratio"] for row in per_block if row["server_ratio"] is not None]
    s_rounds = [x for r in s_recs for x in r["rounds"]]
    p_rounds = [x for r in p_recs for x in r["rounds"]]
    tokens = sum(r["tokens"] for r in s_recs)
    rounds = len(s_rounds)
    by_source: dict[str, list[int]] = {}
    for x in s_rounds:
        if x["retained"]:
            counts = by_source.setdefault(x["source"], [0, 0])
            counts[0] += x["retained"]
            counts[1] += x["accepted"]
    # Per-step conditional acceptance: step i judged iff >= i drafts retained and the i-1 before accepted.
    steps = []
    for i in range(1, k_max + 1):
        judged = [x for x in s_rounds if x["retained"] >= i and x["accepted"] >= i - 1]
        steps.append(sum(1 for x in judged if x["accepted"] >= i) / len(judged) if judged else None)
    c1 = mean(x["verify_ms"] for x in p_rounds)
    windows: dict[int, list[float]] = {}
    for x in s_rounds:
        windows.setdefault(x["retained"] + 1, []).append(x["verify_ms"])
    curve = []
    r_k, survive = 1.0, 1.0
    for k in range(0, k_max + 1):
        if k:
            a = steps[k - 1]
            if a is None:
                break
            survive *= a
            r_k += survive
        c = mean(windows.get(k + 1, [])) if k else c1
        curve.append({"k": k, "window": k + 1, "rounds": len(windows.get(k + 1, [])), "verify_ms": c,
                      "cost_ratio": c / c1 if c and c1 else None, "R_k": r_k,
                      "ideal": r_k * c1 / c if c and c1 else None})
    s_verify = sum(x["verify_ms"] for x in s_rounds)
    p_verify = sum(x["verify_ms"] for x in p_rounds)
    p_tokens = sum(r["tokens"] for r in p_recs)
    ideal = (tokens / s_verify) / (p_tokens / p_verify) if s_verify and p_verify and p_tokens else None
    mid = statistics.median(ratios) if ratios else None
    decode_ratios = [row["decode_ratio"] for row in per_block if row["decode_ratio"] is not None]
    mid_decode = statistics.median(decode_ratios) if decode_ratios else None
    s_decode_s = sum(r["wall_s"] - r["first_s"] for r in s_recs if r.get("first_s") is not None)
    # waits of the rounds that asked the drafter (the governor may have decoded the rest plainly)
    waits = [x["draft_wait_ms"] for x in s_rounds if x["round_id"] >= 1 and x.get("speculative", True)]
    identical = sum(
        1 for r in s_recs for q in p_recs if q["block"] == r["block"] and q["prompt"] == r["prompt"] and q["token_ids"] == r["token_ids"])
    return {
        "arm": spec.name, "alpha": spec.alpha, "per_block": per_block, "median_ratio": mid,
        "min_ratio": min(ratios) if ratios else None, "max_ratio": max(ratios) if ratios else None,
        "median_server_ratio": statistics.median(server_ratios) if server_ratios else None,
        "tokens": tokens, "rounds": rounds, "requests": len(s_recs),
        "mean_accepted_length": tokens / rounds if rounds else None,
        "acceptance_by_source": {k: a / r for k, (r, a) in sorted(by_source.items())},
        "drafts_retained_per_round": mean(x["retained"] for x in s_rounds),
        "per_step_acceptance": steps,
        "faults": sum(r["stats"]["drafter_faults"] for r in s_recs),
        "spec_wall_ms_per_round": 1e3 * sum(r["wall_s"] for r in s_recs) / rounds if rounds else None,
        "spec_verify_ms": mean(x["verify_ms"] for x in s_rounds),
        "draft_wait_ms": mean(waits),
        "draft_wait_median_ms": median(waits),
        "draft_wait_p95_ms": percentile(waits, 95),
        "waited_share": sum(1 for x in s_rounds if x.get("speculative", True)) / rounds if rounds else None,
        "detaches": sum(r["stats"].get("drafter_detaches", 0) for r in s_recs),
        # rounds whose chain had been drafted ahead of the previous commit and came true
        "ahead_hit_share": sum(r["stats"].get("ahead_hits", 0) for r in s_recs) / rounds if rounds else None,
        "open_wait_ms": mean(x["draft_wait_ms"] for x in s_rounds if x["round_id"] == 0),
        "plain_wall_ms_per_round": 1e3 * sum(r["wall_s"] for r in p_recs) / len(p_rounds) if p_rounds else None,
        "c1_ms": c1, "curve": curve, "ideal": ideal,
        "fraction_realised": mid / ideal if mid and ideal else None,
        "median_decode_ratio": mid_decode,
        "min_decode_ratio": min(decode_ratios) if decode_ratios else None,
        "max_decode_ratio": max(decode_ratios) if decode_ratios else None,
        "fraction_realised_decode": mid_decode / ideal if mid_decode and ideal else None,
        "spec_decode_wall_ms_per_round": 1e3 * s_decode_s / rounds if rounds and s_decode_s else None,
        "identical_outputs": f"{identical}/{len(s_recs)}",
    }


def report(setup: str, header: dict, summaries: list[dict], costs: dict[str, dict], plain: Arm, synthetic: bool) -> str:
    out = []
    label = " (SYNTHETIC drafts: replay drafter)" if synthetic else ""
    out.append(f"### pair_speedup: {setup}{label}, {time.strftime('%Y-%m-%d')}")
    out.append("")
    out.append("; ".join(f"{k} {v}" for k, v in header.items()))
    out.append("")
    out.append("Per block (tokens/s = completion tokens / client wall time of the block's requests):")
    out.append("")
    out.append("| arm | block | order | spec tokens/s | plain tokens/s | ratio | ratio (server tokens/s) "
               "| ratio from the first token |")
    out.append("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for s in summaries:
        for row in s["per_block"]:
            order = "spec first" if row["spec_first"] else "plain first"
            out.append(f"| {s['name']} | {row['block'] + 1} | {order} | {row['spec_tps']:.1f} | {row['plain_tps']:.1f} | "
                       f"{row['ratio']:.3f} | {fmt(row['server_ratio'], '.3f')} | {fmt(row['decode_ratio'], '.3f')} |")
    out.append("")
    out.append("| arm | median of paired ratios [min, max] | same, server tokens/s | mean accepted length (bonus incl.) "
               "| acceptance by source | per-step acceptance a_1..a_k | drafts retained/round | rounds/request "
               "| faults | rounds that waited for a chain | rounds on a chain drafted ahead | drafter detaches "
               "| spec = plain outputs | ideal (verify-only) | fraction realised "
               "| from the first token: median ratio [min, max], fraction realised |")
    out.append("| --- | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for s in summaries:
        sources = ", ".join(f"{k} {v:.2f}" for k, v in s["acceptance_by_source"].items()) or "-"
        steps = " ".join(fmt(a, ".2f", "-") for a in s["per_step_acceptance"])
        out.append(
            f"| {s['name']} | **{fmt(s['median_ratio'], '.3f')}** [{fmt(s['min_ratio'], '.3f')}, {fmt(s['max_ratio'], '.3f')}] "
            f"| {fmt(s['median_server_ratio'], '.3f')} | {fmt(s['mean_accepted_length'])} | {sources} | {steps} "
            f"| {fmt(s['drafts_retained_per_round'])} | {s['rounds'] / max(s['requests'], 1):.1f} | {s['faults']} "
            f"| {fmt(s['waited_share'], '.2f')} | {fmt(s['ahead_hit_share'], '.2f')} | {s['detaches']} "
            f"| {s['identical_outputs']} | {fmt(s['ideal'], '.3f')} | {fmt(s['fraction_realised'], '.2f')} "
            f"| {fmt(s['median_decode_ratio'], '.3f')} [{fmt(s['min_decode_ratio'], '.3f')}, "
            f"{fmt(s['max_decode_ratio'], '.3f')}], {fmt(s['fraction_realised_decode'], '.2f')} |")
    out.append("")
    out.append("Per round (ms; means over all timed rounds unless 'median'; 'draft wait' = RoundInfo.draft_wait_ms of "
               "rounds >= 1, round 0's wait includes the drafter's open; hop + service overhead = median draft wait - "
               "median drafter compute):")
    out.append("")
    out.append("| arm | spec wall/round | from the first token | spec verify | draft wait (mean / median / p95) | round-0 wait "
               "| drafter compute (median) | hop + service overhead "
               "| plain wall/round | plain verify (C1) | bytes up/commit | bytes down/chain | bytes up/open | cost method |")
    out.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for s in summaries:
        c = costs.get(s["name"], {})
        compute = c.get("commit_ms")
        wait = s["draft_wait_median_ms"]
        hop = wait - compute if wait is not None and compute is not None else None
        out.append(
            f"| {s['name']} | {fmt(s['spec_wall_ms_per_round'])} | {fmt(s['spec_decode_wall_ms_per_round'])} "
            f"| {fmt(s['spec_verify_ms'])} "
            f"| {fmt(s['draft_wait_ms'])} / {fmt(wait)} / {fmt(s['draft_wait_p95_ms'])} "
            f"| {fmt(s['open_wait_ms'])} | {fmt(compute, '.3f')} | {fmt(hop)} | {fmt(s['plain_wall_ms_per_round'])} "
            f"| {fmt(s['c1_ms'])} | {fmt(c.get('commit_bytes'), '.0f')} | {fmt(c.get('chain_bytes'), '.0f')} "
            f"| {fmt(c.get('open_bytes'), '.0f')} | {c.get('method', 'n/a')} |")
    out.append("")
    out.append("Cost curve and ideal per chain length k (C(w) = mean verify_ms of w-row windows in the spec arm; "
               "C(1) = the plain arm's; R_k from the per-step acceptance):")
    out.append("")
    out.append("| arm | k | window w | rounds | C(w) ms | C(w)/C(1) | R_k | R_k / (C(k+1)/C(1)) |")
    out.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for s in summaries:
        for row in s["curve"]:
            rounds = row["rounds"] if row["k"] else "plain"
            out.append(f"| {s['name']} | {row['k']} | {row['window']} | {rounds} | {fmt(row['verify_ms'])} | "
                       f"{fmt(row['cost_ratio'])} | {row['R_k']:.2f} | {fmt(row['ideal'], '.3f')} |")
    return "\n".join(out)
