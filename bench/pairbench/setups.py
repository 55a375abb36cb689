"""The setups end to end: start the services, run warm-up and blocks, collect the costs.

run_embedded: cpu-embedded / gpu-embedded (tandem drafter, optional tap pass).
run_synthetic: cpu-synthetic / gpu-synthetic (reference outputs, then the replay drafter).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from shared.client import AsyncVerifierClient

from . import REPO
from .common import PROMPTS, SHAPES, ServiceError, free_port, log
from .costs import replay_real_drafter, replay_stats, synthetic_costs, tap_costs
from .runs import Arm, Run
from .services import Children, Tap, link_flags


def text_prompts(model_dir: Path, count: int, prompt_set: str = "code") -> list[list[int]]:
    from shared.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise ServiceError(f"{model_dir} has no tokenizer: the built-in text prompts need one")
    texts = PROMPTS if prompt_set == "code" else repeat_prompts()
    if count > len(texts):
        raise ServiceError(f"--prompts {count}: there are {len(texts)} {prompt_set} prompts")
    return [tokenizer.encode(p).ids for p in texts[:count]]


def code_prompts(model_dir: Path, count: int, offset: int = 0) -> list[list[int]]:
    """The built-in code prompts, each made distinct by a numbered comment (any count)."""
    from shared.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    return [tokenizer.encode(f"# variant {offset + i}\n" + PROMPTS[i % len(PROMPTS)]).ids for i in range(count)]


def repeat_prompts() -> list[str]:
    """Repeat-with-edits prompts: a piece of real code (standard library sources), then the
    request to write it again with one name changed, and the first lines of that version;
    the completion's natural continuation repeats the piece with the edit."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for name in ("json/decoder.py", "json/encoder.py", "textwrap.py", "shlex.py", "fnmatch.py", "glob.py",
                 "colorsys.py", "bisect.py"):
        text = (stdlib / name).read_text()
        lines = text.splitlines(keepends=True)
        start = next(i for i, line in enumerate(lines) if line.startswith(("def ", "class ")))
        piece = "".join(lines[start : start + 40])
        first = piece.split("(")[0].split()[-1]  # the first def/class name
        edited = piece.replace(first, first + "_v2")
        prompts.append(piece + f"\n\n# The same code, with {first} renamed to {first}_v2:\n\n"
                       + "".join(edited.splitlines(keepends=True)[:3]))
    return prompts


def random_prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


async def run_embedded(args, children: Children, workdir: Path) -> tuple[list[dict], dict, list[Arm], Arm, dict]:
    from shared.model.registry import resolve_model

    device = "cuda" if args.setup.startswith("gpu") else "cpu"
    model_dir = resolve_model(args.model)
    prompts = text_prompts(model_dir, args.prompts, args.prompt_set)
    run = Run(args, prompts)
    d_port, v_port, t_port, tv_port = free_port(), free_port(), free_port(), free_port()
    common = ["--model", str(model_dir), "--device", device, "--dtype", args.dtype]
    drafter_args = [*common, "--port", str(d_port)]
    if not args.global_index:
        drafter_args += ["--global-index-mb", "0"]
    verifier_link, drafter_link = link_flags(args.link, workdir / "drafter.sock")
    drafter_args += [*drafter_link, *args.drafter_arg]
    verifier_args = [*common, "--max-draft-tokens", str(args.max_draft_tokens), "--grace-s", "2", *args.verifier_arg]
    log("starting services ...")
    children.start("drafter", [sys.executable, "-m", "shared.cli", "drafter", *drafter_args])
    children.start("verifier", [sys.executable, "-m", "shared.cli", "verifier", *verifier_args, "--port", str(v_port),
                                "--drafter", f"127.0.0.1:{d_port}", *verifier_link])
    tap = None
    spec, plain = Arm("spec", True), Arm("plain", False)
    arms = [spec, plain]
    costs: dict = {}
    tap_records: list[dict] = []
    try:
        if not args.no_tap:
            children.start("tap-verifier", [sys.executable, "-m", "shared.cli", "verifier", *verifier_args,
                                            "--port", str(tv_port), "--drafter", f"127.0.0.1:{t_port}"])
            tap = Tap(f"127.0.0.1:{d_port}")
            await tap.start(t_port)
        waits = [children.wait_serving("drafter", f"127.0.0.1:{d_port}", args.startup_timeout),
                 children.wait_serving("verifier", f"127.0.0.1:{v_port}", args.startup_timeout)]
        if tap:
            waits.append(children.wait_serving("tap-verifier", f"127.0.0.1:{tv_port}", args.startup_timeout))
        await asyncio.gather(*waits)
        async with AsyncVerifierClient(f"127.0.0.1:{v_port}", timeout=args.request_timeout) as client:
            log(f"warm-up ({len(arms)} requests) ...")
            seconds = await run.warm_up(client, arms)
            log(f"  warm-up {seconds:.1f}s")
            await run.blocks(client, arms, children)
        if tap:
            log(f"tap pass: {len(prompts)} spec requests through the byte-counting tap (untimed) ...")
            try:
                async with AsyncVerifierClient(f"127.0.0.1:{tv_port}", timeout=args.request_timeout) as client:
                    for index in range(len(prompts)):
                        tap_records.append(await run.request(client, spec, index, "tap"))
            except ServiceError as error:
                log(f"  tap pass failed: {error}")
            if tap_records:
                c = tap_costs(tap.streams)
                timed = {r["prompt"]: r["token_ids"] for r in run.records if r["arm"] == "spec"}
                c["same_tokens_as_timed"] = sum(1 for r in tap_records if timed.get(r["prompt"]) == r["token_ids"])
                log("replaying the captured streams into an in-process Drafter (compute timing) ...")
                try:
                    c.update(replay_real_drafter(tap.streams, str(model_dir), device, args.dtype, args.threads))
                    c["method"] = ("bytes: tap, untimed pass; compute: in-process Drafter commit+propose "
                                   "on the captured messages")
                except Exception as error:  # report what was measured, name what was not
                    log(f"  in-process replay failed: {type(error).__name__}: {error}")
                    c["commit_ms"] = None
                    c["method"] = f"bytes: tap; compute: n/a ({type(error).__name__})"
                costs["spec"] = c
    finally:
        if tap is not None:
            await tap.stop()
    header = {"model": model_dir.name, "device": device, "dtype": args.dtype, "verifier flags": " ".join(args.verifier_arg) or "defaults",
              "drafter link": args.link,
              "drafter": "tandem drafter (MTP + suffix)" + ("" if args.global_index else ", cross-session index off")}
    if tap_records:
        header["tap-pass outputs equal to the timed spec arm"] = (
            f"{costs.get('spec', {}).get('same_tokens_as_timed', 0)}/{len(tap_records)}")
    extra = {"tap": {k: v for k, v in costs.get("spec", {}).items()}, "tap_records": tap_records}
    return run.records, header, arms, plain, {"costs": costs, "extra": extra}


async def run_synthetic(args, children: Children, workdir: Path) -> tuple[list[dict], dict, list[Arm], Arm, dict]:
    from shared.model.registry import resolve_model

    gpu = args.setup.startswith("gpu")
    device = "cuda" if gpu else "cpu"
    dtype = args.dtype if args.dtype_given or not gpu else "bfloat16"
    shapes = args.random_shapes or ("qwen3-30b-a3b" if gpu and not args.model else None)
    if shapes:
        model_dir = workdir / f"{shapes}-shapes"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(SHAPES[shapes], indent=1))
        vocab = SHAPES[shapes]["vocab_size"]
        prompts = random_prompts(vocab, args.prompts, args.prompt_length, args.seed)
        model_args = ["--model", str(model_dir), "--random-weights"]
        model_name = f"random {dtype} weights at {shapes} shapes, random prompts of {args.prompt_length} ids"
    else:
        model_dir = resolve_model(args.model)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        prompts = text_prompts(model_dir, args.prompts, args.prompt_set)
        model_args = ["--model", str(model_dir)]
        model_name = model_dir.name
    run = Run(args, prompts)
    r_port, v_port = free_port(), free_port()
    verifier_link, drafter_link = link_flags(args.link, workdir / "replay.sock")
    log("starting the verifier ...")
    children.start("verifier", [sys.executable, "-m", "shared.cli", "verifier", *model_args, "--device", device,
                                "--dtype", dtype, "--port", str(v_port), "--drafter", f"127.0.0.1:{r_port}", *verifier_link,
                                "--max-draft-tokens", str(args.max_draft_tokens), "--grace-s", "2", *args.verifier_arg])
    await children.wait_serving("verifier", f"127.0.0.1:{v_port}", args.startup_timeout)
    plain = Arm("plain", False)
    spec_arms = [Arm(f"synthetic alpha={a:g}", True, a) for a in args.alpha]
    if args.ahead_ab:  # the same alphas without chains drafted ahead, interleaved in the same blocks
        spec_arms += [Arm(f"synthetic alpha={a:g}, no draft-ahead", True, a, "@no-ahead") for a in args.alpha]
    arms = [plain, *spec_arms]
    stats_path = workdir / "replay_stats.jsonl"
    async with AsyncVerifierClient(f"127.0.0.1:{v_port}", timeout=args.request_timeout) as client:
        log(f"recording the reference: {len(prompts)} plain requests ...")
        await run.request(client, plain, 0, "warmup-ref")
        references = []
        for index in range(len(prompts)):
            record = await run.request(client, plain, index, "ref")
            references.append({"prompt_ids": prompts[index], "token_ids": record["token_ids"]})
        reference_path = workdir / "reference.json"
        reference_path.write_text(json.dumps({"label": "synthetic", "vocab_size": vocab, "references": references}))
        children.start("replay-drafter", [sys.executable, str(REPO / "bench" / "replay_drafter.py"), "--port", str(r_port),
                                          "--reference", str(reference_path), "--alpha", str(args.alpha[0]),
                                          "--seed", str(args.seed), "--max-drafts", str(args.max_draft_tokens),
                                          "--stats", str(stats_path), "--delay-ms", str(args.drafter_delay_ms), *drafter_link])
        await children.wait_serving("replay-drafter", f"127.0.0.1:{r_port}", args.startup_timeout)
        log(f"warm-up ({len(arms)} requests) ...")
        seconds = await run.warm_up(client, arms)
        log(f"  warm-up {seconds:.1f}s")
        await run.blocks(client, arms, children)
    children.stop("replay-drafter")
    stats = replay_stats(stats_path)
    costs = {}
    for arm in spec_arms:
        timed = [s for s in stats if s["session_id"].startswith("spec-b") and s["alpha"] == arm.alpha
                 and s["session_id"].endswith(arm.tag or f"@alpha={arm.alpha:g}")]
        c = synthetic_costs(timed)
        c["method"] = "replay drafter, timed runs: ByteSize per message, compute = received -> chain built"
        costs[arm.name] = c
    reference_ok = sum(1 for r in run.records if r["speculation"] and r["token_ids"] == references[r["prompt"]]["token_ids"])
    header = {"model": model_name, "device": device, "dtype": dtype, "drafter": "bench/replay_drafter.py (synthetic)"
              + (f", chains {args.drafter_delay_ms:g} ms late" if args.drafter_delay_ms else ""),
              "verifier flags": " ".join(args.verifier_arg) or "defaults", "drafter link": args.link,
              "spec outputs equal to the reference": f"{reference_ok}/{sum(1 for r in run.records if r['speculation'])}"}
    return run.records, header, arms, plain, {"costs": costs, "extra": {"replay_stats": stats, "references": references}}
