"""What concurrent requests gain over one at a time, as a newcomer runs tandem (issue 35's CPU bar).

The service pair with its default flags (tandem's drafter: MTP and suffix drafts; the verifier
as `scripts/demo` starts it, Draft streams on the drafter's Unix socket unless --link grpc) on
the embedded model, and N mixed requests — even indices greedy, odd ones sampled (temperature
0.8, top-p 0.95, seed = index) — over the built-in code prompts.
Each block runs the N requests alone (one after another) and together (all N at once), in
alternating order. Reported per block: one request's tokens/s (the alone phase's tokens over its
summed walls), the together phase's aggregate tokens/s (its tokens over its wall), their ratio,
and whether every request's tokens together equal its tokens alone (exact mode: they must), and
the CPU time each service and the clients (this process) spent a token in each phase (Linux's
/proc: every thread and child process (a verifier's fronts), user and system; a service's work,
which scheduling noise moves less than the walls), and how many cores the three kept busy
together (their CPU over the phase's wall: on a small host, what is left). Per phase also where the verifier's time went: its engine loop's wall by
what it did (its metric tandem_verifier_engine_seconds: stepping, jobs, gathering a step's
lanes, idle, the rest) and its event loop's CPU (the main thread's, where request coroutines
run) as shares of the phase's wall — whether the model's steps or the host's work between them
set the pace.
The claim is the median of the blocks' ratios. With --baseline-tree the same is measured
from another checkout first (services from that tree), alternating trees per block.

    python bench/concurrency_gain.py [--device cpu] [--requests 8] [--max-new-tokens 64] [--blocks 3]
        [--link local|grpc] [--baseline-tree /tmp/base [--baseline-link grpc|local]]
        [--baseline-tree . --baseline-link local --traced this-tree]   (what exporting traces costs)
        [--client-link grpc --baseline-tree . --baseline-link local]    (what gRPC's events cost: clients
                                                                         held on the verifier's port)
        [--baseline-tree . --baseline-link local --verifier-arg=--front-processes --verifier-arg=1]
                                                                        (the port served by a front process)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from urllib.request import urlopen

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pairbench import REPO  # noqa: E402  (puts the repository and protocol modules on sys.path)
from pairbench.common import cpu_seconds, log  # noqa: E402
from pairbench.services import Children, ServicePair, free_port, link_flags  # noqa: E402
from pairbench.setups import code_prompts  # noqa: E402
from pairbench.trace_sink import TraceSink  # noqa: E402


def config(index: int, max_new_tokens: int, tag: str):
    from shared.client import GenerationConfig

    sampled = index % 2 == 1
    return GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.8 if sampled else 0.0,
                            top_p=0.95 if sampled else 1.0, seed=index, request_id=f"{tag}-r{index}")


ENGINE_STATES = ("step", "job", "gather", "idle", "other")


def engine_seconds(metrics_port: int) -> dict[str, float]:
    """The verifier's engine loop seconds by state so far (empty where a tree has no such metric)."""
    text = urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    spent = {}
    for line in text.splitlines():
        if line.startswith("tandem_verifier_engine_seconds_total{"):
            state = line.split('state="', 1)[1].split('"', 1)[0]
            spent[state] = float(line.rsplit(" ", 1)[1])
    return spent


class Pair(ServicePair):
    """The drafter and verifier of one tree, default flags; a phase of requests through them."""

    def __init__(self, name: str, children: Children, model_dir: Path, device: str, tree: Path | None,
                 verifier_args: list[str], drafter_args: list[str], env: dict[str, str] | None,
                 client_link: str = "default", client_socket: Path | None = None) -> None:
        self.metrics_port = free_port()  # (where the verifier's engine loop says what it did)
        self.client_link = client_link  # default: the client's own choice (the socket its verifier names)
        self.client_socket = client_socket  # (the verifier's --local-socket, which the clients then take)
        socket_args = ["--local-socket", str(client_socket)] if client_socket else []
        super().__init__(name, children, model_dir, device, tree,
                         [*verifier_args, *socket_args, "--metrics-port", str(self.metrics_port)], drafter_args, env)

    def cpu(self) -> tuple[float, float, float, float]:
        """(the verifier's, the drafter's, the clients' (this process's), the verifier's main thread's)
        CPU seconds so far."""
        procs = self.children.procs
        verifier = procs[f"{self.name}-verifier"][0].pid
        return (cpu_seconds(verifier), cpu_seconds(procs[f"{self.name}-drafter"][0].pid), time.process_time(),
                cpu_seconds(verifier, verifier))

    async def phase(self, prompts: list[list[int]], together: bool, max_new_tokens: int, tag: str) -> dict:
        """Tokens per request, summed request walls, the phase's wall, the services' CPU seconds, the
        engine loop's states and the event loop's CPU as shares of the wall."""
        from shared.client import AsyncVerifierClient

        socket = str(self.client_socket) if self.client_socket else None
        async with AsyncVerifierClient(f"127.0.0.1:{self.v_port}", timeout=600, local_socket=socket,
                                       discover_local=self.client_link == "default") as client:
            async def one(index: int) -> tuple[list[int], float, dict]:
                started = time.perf_counter()
                g = await client.generate(prompts[index], config(index, max_new_tokens, tag))
                waits = [r["draft_wait_ms"] for r in g.rounds if r["speculative"]]
                return g.token_ids, time.perf_counter() - started, {**g.stats, "wait_ms": sum(waits)}

            cpu_before, engine_before = self.cpu(), engine_seconds(self.metrics_port)
            started = time.perf_counter()
            if together:
                results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
            else:
                results = [await one(i) for i in range(len(prompts))]
            wall = time.perf_counter() - started
            cpu = [after - before for before, after in zip(cpu_before, self.cpu())]
            engine = {state: (seconds - engine_before.get(state, 0.0)) / wall
                      for state, seconds in engine_seconds(self.metrics_port).items()}
        rounds = sum(stats.get("rounds", 0) for _, _, stats in results)
        speculative = sum(stats.get("speculative_rounds", 0) for _, _, stats in results)
        return {"tokens": [ids for ids, _, _ in results], "walls": sum(w for _, w, _ in results), "wall": wall,
                "speculative": speculative / rounds if rounds else 0.0,
                "wait_ms": sum(stats["wait_ms"] for _, _, stats in results), "cpu": cpu[:3],
                "cores": sum(cpu[:3]) / wall, "engine": engine, "event_loop": cpu[3] / wall}


async def main_async(args) -> None:
    from shared.model.registry import resolve_model

    model_dir = resolve_model(args.model)
    prompts = code_prompts(model_dir, args.requests)
    workdir = Path(tempfile.mkdtemp(prefix="concurrency-gain-"))
    children = Children(workdir, threads=args.threads)
    pairs: list[Pair] = []
    sink = TraceSink() if args.traced != "none" else None
    try:
        if sink is not None:
            sink.start()

        def env(name: str) -> dict[str, str] | None:  # (a traced pair exports to the sink; an other none)
            return None if sink is None else sink.env(args.traced in (name, "both"))

        if args.baseline_tree:
            v_args, d_args = link_flags(args.baseline_link, workdir / "baseline.sock")
            pairs.append(Pair("baseline", children, model_dir, args.device, Path(args.baseline_tree),
                              [*v_args, *args.baseline_verifier_arg], [*d_args, *args.baseline_drafter_arg],
                              env("baseline"), args.baseline_client_link,
                              workdir / "baseline-gen.sock" if args.baseline_client_link == "local" else None))
        v_args, d_args = link_flags(args.link, workdir / "this-tree.sock")
        pairs.append(Pair("this-tree", children, model_dir, args.device, None, [*v_args, *args.verifier_arg],
                          [*d_args, *args.drafter_arg], env("this-tree"), args.client_link,
                          workdir / "this-tree-gen.sock" if args.client_link == "local" else None))
        log("starting services ...")
        for pair in pairs:
            await pair.ready()
        for pair in pairs:  # warm-up, untimed: every request once together, then one alone (on a GPU a
            # lone session's first chains pay the drafter's own warm-up: docs/PERFORMANCE.md, session 44)
            await pair.phase(prompts, True, args.max_new_tokens, "warm")
            await pair.phase(prompts[:1], False, args.max_new_tokens, "warm-alone")
        rows = []
        reference: dict[str, list[list[int]]] = {}
        for block in range(args.blocks):
            for pair in pairs if block % 2 == 0 else pairs[::-1]:
                order = (False, True) if block % 2 == 0 else (True, False)
                out = {}
                for together in order:
                    children.check_alive()
                    out[together] = await pair.phase(prompts, together, args.max_new_tokens, f"b{block}")
                alone, both = out[False], out[True]
                tokens_alone = sum(len(t) for t in alone["tokens"])
                tokens_both = sum(len(t) for t in both["tokens"])
                one_tps = tokens_alone / alone["walls"]
                together_tps = tokens_both / both["wall"]
                reference.setdefault(pair.name, alone["tokens"])
                rows.append(dict(
                    tree=pair.name, block=block, one=one_tps, together=together_tps, ratio=together_tps / one_tps,
                    identical=sum(a == b for a, b in zip(alone["tokens"], both["tokens"])),
                    spec_alone=alone["speculative"], spec_together=both["speculative"],
                    cpu_alone=[1e6 * c / tokens_alone for c in alone["cpu"]],
                    cpu_together=[1e6 * c / tokens_both for c in both["cpu"]],
                    stable=sum(a == b for a, b in zip(alone["tokens"], reference[pair.name])),
                    engine_alone=alone["engine"], engine_together=both["engine"],
                    loop_alone=alone["event_loop"], loop_together=both["event_loop"], cores_together=both["cores"]))
                log(f"block {block + 1}/{args.blocks} {pair.name}: one request {one_tps:.1f} tokens/s, "
                    f"{len(prompts)} together {together_tps:.1f} ({together_tps / one_tps:.2f}x), identical "
                    f"{rows[-1]['identical']}/{len(prompts)}, speculative rounds {alone['speculative']:.0%} alone, "
                    f"{both['speculative']:.0%} together (their chains waited for: {alone['wait_ms']:.0f} / "
                    f"{both['wait_ms']:.0f} ms in all)")
    finally:
        children.stop()
        if sink is not None:
            sink.stop()
    print(f"\n### concurrency_gain: {datetime.date.today()}, {platform.node()}, device {args.device}, "
          f"model {model_dir.name}, {len(prompts)} requests (greedy and sampled alternating), "
          f"{args.max_new_tokens} new tokens, links (drafter, client): this tree {args.link}, {args.client_link}"
          + (f"; baseline {args.baseline_link}, {args.baseline_client_link}" if args.baseline_tree else "") + f"; verifier flags: this tree {' '.join(args.verifier_arg) or 'defaults'}"
          + (f", baseline {' '.join(args.baseline_verifier_arg) or 'defaults'}" if args.baseline_tree else "")
          + (f"; drafter flags: this tree {' '.join(args.drafter_arg) or 'defaults'}"
             + (f", baseline {' '.join(args.baseline_drafter_arg) or 'defaults'}" if args.baseline_tree else "")
             if args.drafter_arg or args.baseline_drafter_arg else "")
          + (f"; traces: {args.traced} export to a local OTLP sink ({sink.spans:,} spans, {sink.bytes / 1e6:.1f} MB"
             f" received)" if sink is not None else "") + "\n")
    print("| tree | block | one request, tokens/s | together, tokens/s | together / one | together = alone | alone = block 1 "
          "| speculative rounds alone / together | CPU µs a token alone, verifier / drafter / clients | together "
          "| cores busy together |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['tree']} | {r['block'] + 1} | {r['one']:.1f} | {r['together']:.1f} | {r['ratio']:.2f} "
              f"| {r['identical']}/{len(prompts)} | {r['stable']}/{len(prompts)} "
              f"| {r['spec_alone']:.0%} / {r['spec_together']:.0%} "
              f"| {' / '.join(f'{c:.0f}' for c in r['cpu_alone'])} | {' / '.join(f'{c:.0f}' for c in r['cpu_together'])} "
              f"| {r['cores_together']:.2f} |")
    print()
    print("Where the verifier's wall went (shares of each phase's wall): its engine loop "
          + " / ".join(ENGINE_STATES) + "; its event loop's CPU\n")
    print("| tree | block | engine loop, alone | event loop, alone | engine loop, together | event loop, together |")
    print("| --- | ---: | --- | ---: | --- | ---: |")
    for r in rows:
        shares = [" / ".join(f"{r[key].get(state, 0.0):.0%}" for state in ENGINE_STATES) if r[key] else "—"
                  for key in ("engine_alone", "engine_together")]
        print(f"| {r['tree']} | {r['block'] + 1} | {shares[0]} | {r['loop_alone']:.0%} | {shares[1]} "
              f"| {r['loop_together']:.0%} |")
    print()
    for pair in pairs:
        ratios = [r["ratio"] for r in rows if r["tree"] == pair.name]
        print(f"{pair.name}: median together / one {statistics.median(ratios):.2f} over {len(ratios)} blocks")
    if len(pairs) == 2:
        blocks = list(zip([r for r in rows if r["tree"] == "baseline"], [r for r in rows if r["tree"] == "this-tree"]))
        for key, what in (("one", "one request"), ("together", "together")):
            paired = [mine[key] / base[key] for base, mine in blocks]
            print(f"this tree / baseline, {what} tokens/s: median of paired ratios {statistics.median(paired):.2f} "
                  f"({min(paired):.2f}-{max(paired):.2f})")
        for key, what in (("cpu_alone", "one request"), ("cpu_together", "together")):
            for index, service in enumerate(("verifier", "drafter", "clients")):
                paired = [mine[key][index] / base[key][index] for base, mine in blocks if base[key][index]]
                if paired:
                    print(f"this tree / baseline, {what}, the {service}'s CPU a token: median of paired ratios "
                          f"{statistics.median(paired):.2f} ({min(paired):.2f}-{max(paired):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per service (0: torch's default)")
    parser.add_argument("--link", default="local", choices=("local", "grpc"),
                        help="this tree's drafter link: local (as `tandem demo` starts the pair) or grpc")
    parser.add_argument("--baseline-link", default="grpc", choices=("local", "grpc"),
                        help="the baseline's (grpc: a tree before session 40 has no local socket)")
    parser.add_argument("--client-link", default="default", choices=("default", "grpc", "local"),
                        help="how this tree's clients reach the verifier: default (the client's own way: the local "
                             "socket a verifier names to callers on its host, else its port), grpc (its port only) "
                             "or local (its --local-socket)")
    parser.add_argument("--baseline-client-link", default="default", choices=("default", "grpc", "local"),
                        help="the same for the baseline (local needs a tree with --local-socket; a tree that names "
                             "no socket keeps default clients on its port)")
    parser.add_argument("--baseline-tree", default=None, help="another checkout, measured alongside (may be this one)")
    parser.add_argument("--traced", default="none", choices=("none", "this-tree", "baseline", "both"),
                        help="that pair's services export traces (OTLP/gRPC) to a sink this bench runs, the other "
                             "pair's none (with --baseline-tree . : what tracing costs); both: both pairs")
    parser.add_argument("--verifier-arg", action="append", default=[], help="a verifier flag for this tree (repeat)")
    parser.add_argument("--baseline-verifier-arg", action="append", default=[], help="a verifier flag for the baseline (repeat)")
    parser.add_argument("--drafter-arg", action="append", default=[], help="a drafter flag for this tree (repeat)")
    parser.add_argument("--baseline-drafter-arg", action="append", default=[], help="a drafter flag for the baseline (repeat)")
    args = parser.parse_args()
    if args.requests < 2 or args.blocks < 1 or args.max_new_tokens < 1:
        parser.error("--requests >= 2, --blocks >= 1 and --max-new-tokens >= 1")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
