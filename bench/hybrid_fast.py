"""The Qwen3.5-MoE family on the fused, captured path (issue 34): correctness and speed on the GPU.

Random bf16 weights at Qwen3.5-35B-A3B shapes (40 layers: 30 Gated DeltaNet + 10 gated
attention, 256 experts top-8 plus a shared expert). Two parts, each its own process (two
copies of the weights do not fit one GPU):

`--part raw` — in this process, one trunk, the verifier's Engine on it (fused path, CUDA
graphs: exactly what the service runs) and the reference modules on the same weights:
- correctness: fused windows of 1..9 rows against the reference modules (eager, keep_states)
  after a prompt of each `--contexts` (relative error of the logits, argmax agreement);
  bit-identity: a 9-row window rolled back to row 4 against one-row steps of the kept rows
  (and the step after), a decode batch and a verify batch against the same rows alone; exact
  mode through the Engine (decode-ahead, windows, rollback, batches): speculative rounds with
  drafts taken from the plain continuation (every third chain spoiled) give the plain tokens,
  greedy and sampled, alone and as a batch (run_rounds);
- speed: the captured window of T rows replayed (CUDA events, back to back), T = 1..9, at each
  context; ms and the fraction of the floor (bytes a step must move / measured copy bandwidth);
  the distinct experts a T-row window routes to per MoE layer (recorded from an eager run);
  the reference path's eager step on the same weights (paired in this process); decode
  batches of 8 and 32 sequences against their own floor (distinct experts read); prefill
  tokens/s of a `--prefill` prompt (chunks of 2,048, as the service).
`--part accuracy` — why the fused and the reference logits of the 40-layer model differ: with
random weights the family is ill-conditioned in bf16 (the reference modules in bf16 stray
from the same weights in float32 by as much), so each path is compared with the float32
reference on models of 1 linear-attention layer, 1 full-attention layer and 4 layers (real
widths): fused bf16 vs float32 beside reference bf16 vs float32.
`--part service` — `tandem verifier --random-weights` on those shapes in a child process,
from the client: greedy requests after a 512-token prompt (`--blocks`), a sampled one, and
one after the longest context; decode tokens/s = tokens after the first / (last arrival -
first arrival).

    python bench/hybrid_fast.py --part raw [--contexts 512,4096,32768] [--budget-s 330]
    python bench/hybrid_fast.py --part service [--new-tokens 128] [--long-context 32768]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pairbench.common import QWEN3_5_35B_A3B, free_port, log  # noqa: E402  (puts the repo and protocol modules on sys.path)

from bench.model_baseline import copy_bandwidth  # noqa: E402

STARTED = time.perf_counter()
CHUNK = 2048  # prefill chunk (the service's default)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (the CPU: --small, a smoke test of the correctness parts)
SMALL = dict(vocab_size=512, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def elapsed() -> float:
    return time.perf_counter() - STARTED


def step_bytes(model, context: int, *, num_seqs: int = 1, experts_read: float | None = None) -> int:
    """Bytes one decode step of num_seqs sequences must move: weights read once (routed experts:
    experts_read a layer, default top_k), the linear layers' float32 states read and written,
    the KV rows read, one embedding row each."""
    c, item = model.config, model.embed_tokens.weight.element_size()
    per_expert = 3 * c.moe_intermediate_size * c.hidden_size * item
    experts_read = c.num_experts_per_tok if experts_read is None else experts_read
    total = 0
    for name, param in model.named_parameters():
        if name.startswith(("embed_tokens", "mtp.")) or ".mlp.experts." in name:
            continue
        total += param.numel() * item
    num_moe = sum(1 for layer in model.layers if hasattr(layer.mlp, "experts"))
    total += num_moe * int(experts_read * per_expert)
    total += num_seqs * c.hidden_size * item
    state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv = (2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim) \
        * (c.linear_conv_kernel_dim - 1) * item
    num_linear = sum(1 for layer in model.layers if layer.linear)
    total += num_seqs * num_linear * 2 * (state + conv)
    total += num_seqs * model.num_kv_layers * context * 2 * c.num_key_value_heads * c.head_dim * item
    return total


def expected_distinct(num_experts: int, top_k: int, rows: int) -> float:
    """Distinct experts `rows` rows select under uniform routing (a random router's stand-in)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** rows)


def make_spec(prompt: list[int], new_tokens: int, *, temperature: float = 0.0, seed: int = 0, request_id: str = "b"):
    from kernels.retention import RetentionPolicy
    from kernels.sampling import SamplingParams
    from kernels.speculative import Gate, Mode
    from verifier_service.requests import RequestSpec

    sampling = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0)
    return RequestSpec(
        request_id=request_id, prompt_ids=tuple(prompt), max_new_tokens=new_tokens, sampling=sampling, seed=seed,
        mode=Mode.EXACT, gate=Gate.TOP, speculate=True, coupled=False, max_draft_tokens=4,
        retention=RetentionPolicy(), retention_schedule="", retention_min_cum=0.0, eos_token_ids=frozenset(),
        stop_sequences=(),
    )


def replay_ms(graph, steps: int) -> float:
    """ms per replay of a captured graph, `steps` back to back (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


class Raw:
    def __init__(self, args) -> None:
        from shared.model.families.hybrid.loader import random_next
        from shared.model.families.hybrid.config import NextConfig
        from verifier_service.engine import Engine

        self.args = args
        contexts = [int(c) for c in args.contexts.split(",")]
        self.contexts = contexts
        max_context = max(max(contexts), args.prefill) + 64
        shapes = QWEN3_5_35B_A3B | (SMALL if args.small else {}) | dict(num_hidden_layers=args.layers,
                                        layer_types=QWEN3_5_35B_A3B["layer_types"][: args.layers],
                                        max_position_embeddings=max_context)
        config = NextConfig.from_dict(shapes)
        log("building the trunk ...")
        dtype = torch.bfloat16 if DEVICE == "cuda" or args.bf16 else torch.float32
        self.model = random_next(replace(config, mtp_num_hidden_layers=0), dtype=dtype, device=DEVICE, parts="trunk")
        self.bandwidth = copy_bandwidth() if DEVICE == "cuda" else 1e12
        log(f"[{elapsed():.0f}s] copy bandwidth {self.bandwidth / 1e12:.2f} TB/s; building the engine ...")
        tokens = 2 * max_context + 40 * 1024  # two long sequences and the short ones
        self.engine = Engine(self.model, max_context=max_context, prefill_chunk=CHUNK, fused="on", max_sessions=36,
                             max_window=9, max_batch_rows=32, verify_window=5, kv_cache_tokens=tokens,
                             progress=lambda m: log(f"  [{elapsed():.0f}s] {m}"))
        self.runner = self.engine.runner
        self.gen = torch.Generator().manual_seed(0)
        self.results: dict = {"bandwidth_tb_s": self.bandwidth / 1e12}

    def ids(self, n: int) -> list[int]:
        return torch.randint(0, self.model.config.vocab_size, (n,), generator=self.gen).tolist()

    def prefill(self, prompt: list[int], length: int | None = None) -> int:
        """A fresh slot with `prompt` prefilled in CHUNK-token forwards; returns the slot."""
        runner = self.runner
        slot, cache = runner.acquire(length or len(prompt) + 16)
        for start in range(0, len(prompt), CHUNK):
            count = min(CHUNK, len(prompt) - start)
            cache.reserve(count)
            runner.fused.prefill(torch.tensor(prompt[start : start + count], device=DEVICE), [(start, count, slot)],
                                 runner.kv)
        return slot

    # -- correctness ---------------------------------------------------------------------------

    def against_reference(self, context: int, windows: list[int]) -> list[dict]:
        prompt = self.ids(context)
        started = time.perf_counter()
        slot = self.prefill(prompt)
        sync()
        prefill_s = time.perf_counter() - started
        cache = self.model.new_cache(context + 16)
        for start in range(0, context, CHUNK):
            self.model.prefill(torch.tensor(prompt[start : start + CHUNK], device=DEVICE), cache)
        rows = []
        for num_rows in windows:
            window = self.ids(num_rows)
            out = self.runner.run([(slot, window, context)])  # (not settled: the next window starts here too)
            logits, hidden = out.logits[:num_rows].float().clone(), out.hidden[:num_rows].clone()
            sync()
            t0 = time.perf_counter()
            ref_logits, ref_hidden = self.model(torch.tensor(window, device=DEVICE), cache, keep_states=True)
            sync()
            ref_ms = (time.perf_counter() - t0) * 1e3
            cache.truncate(context)
            rows.append(dict(context=context, rows=num_rows, logits_rel_err=rel_err(logits, ref_logits),
                             hidden_rel_err=rel_err(hidden, ref_hidden), reference_ms=ref_ms,
                             argmax_agree=float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())))
            log(f"  [{elapsed():.0f}s] context {context}, T = {num_rows}: logits rel err {rows[-1]['logits_rel_err']:.2e}, "
                f"argmax agree {rows[-1]['argmax_agree']:.2f}, reference step {ref_ms:.1f} ms")
        self.runner.pool.release(slot)
        del cache
        self.results.setdefault("prefill_s_with_reference_check", {})[context] = prefill_s
        return rows

    def bit_identity(self, context: int) -> dict:
        runner, out = self.runner, {}
        prompt = self.ids(context)
        a, b = self.prefill(prompt), self.prefill(prompt)
        window = self.ids(9)
        verified = runner.run([(a, window, context)]).logits[:9].clone()
        runner.settle(a, kept_row=4)
        same = 0
        for j, token in enumerate(window[:5]):
            row = runner.run([(b, [token], context + j)]).logits[0].clone()
            runner.settle(b)
            same += int(torch.equal(row, verified[j]))
        after_a = runner.run([(a, [11], context + 5)]).logits[0].clone()
        after_b = runner.run([(b, [11], context + 5)]).logits[0].clone()
        out["window rows = one-row steps (of 5 kept)"] = same
        out["step after the rollback identical"] = bool(torch.equal(after_a, after_b))
        for s in (a, b):
            runner.pool.release(s)
        # a decode batch of 8 and a verify batch of 4 windows of 5 rows against the same rows alone
        slots = [self.prefill(self.ids(context)) for _ in range(8)]
        tokens = self.ids(8)
        batch = runner.run([(s, [t], context) for s, t in zip(slots, tokens)]).logits[:8].clone()
        alone = [runner.run([(s, [t], context)]).logits[0].clone() for s, t in zip(slots, tokens)]
        out["decode batch rows = alone (of 8)"] = sum(int(torch.equal(x, batch[i])) for i, x in enumerate(alone))
        windows = [self.ids(5) for _ in range(4)]
        batch = runner.run([(s, w, context) for s, w in zip(slots, windows)]).logits[:20].clone()
        same = 0
        for i, (s, w) in enumerate(zip(slots, windows)):
            one = runner.run([(s, w, context)]).logits[:5]
            same += sum(int(torch.equal(one[j], batch[5 * i + j])) for j in range(5))
        out["verify batch rows = window alone (of 20)"] = same
        for s in slots:
            runner.pool.release(s)
        log(f"  [{elapsed():.0f}s] bit identity at context {context}: {out}")
        return out

    def prefill_sharing(self, lengths=(7, 40, 127, 300)) -> list[dict]:
        """A prompt prefilled (all but its last token, as the verifier does) alone, and in one
        forward with two other prompts: are its linear-attention states, and the first token's
        logits (the one-row step of the last token), the same bits? (DESIGN §11: cuBLAS picks its
        kernel by the forward's row count.) With the projections on prefill_linear's fixed tile
        and on cuBLAS (INVARIANT_PREFILL), and what each costs: prefill tokens/s of one 4,096-token
        prompt and of 8 prompts of 512 in one forward, interleaved."""
        import kernels.fused.linear as linear_module

        rows = []
        saved = linear_module.INVARIANT_PREFILL
        try:
            for invariant in (True, False):
                linear_module.INVARIANT_PREFILL = invariant
                rows += [r | {"prefill_gemm": "fixed tile" if invariant else "cuBLAS"} for r in self._sharing(lengths)]
            if self.model.device.type == "cuda":
                rates: dict = {}
                for _ in range(3):
                    for invariant in (True, False):
                        linear_module.INVARIANT_PREFILL = invariant
                        key = "fixed tile" if invariant else "cuBLAS"
                        rates.setdefault(key, []).append((self.prefill_rate(4096), self.shared_prefill_rate(8, 512)))
                for key, values in rates.items():
                    rows.append({"prefill_gemm": key, "tokens_per_s_4096": statistics.median(v[0] for v in values),
                                 "tokens_per_s_8x512": statistics.median(v[1] for v in values)})
        finally:
            linear_module.INVARIANT_PREFILL = saved
        return rows

    def shared_prefill_rate(self, count: int, length: int) -> float:
        """Tokens/s of `count` prompts of `length` prefilled in one forward (fresh slots)."""
        runner = self.runner
        slots = []
        for _ in range(count):
            slot, cache = runner.acquire(length + 16)
            cache.reserve(length)
            slots.append(slot)
        ids = torch.tensor(self.ids(count * length), device=DEVICE)
        sync()
        started = time.perf_counter()
        runner.fused.prefill(ids, [(0, length, s) for s in slots], runner.kv)
        sync()
        seconds = time.perf_counter() - started
        for s in slots:
            runner.pool.release(s)
        return count * length / seconds

    def _sharing(self, lengths) -> list[dict]:
        runner, fused, rows = self.runner, self.runner.fused, []
        longest = runner.pool.max_length - 20
        for length in [n for n in lengths if n <= longest]:
            prompt, big, small = self.ids(length), self.ids(min(500, longest)), self.ids(33)
            body = length - 1
            slots = []
            for sharing in (False, True):
                slot, cache = runner.acquire(length + 16)
                others = []
                if sharing:
                    others = [runner.acquire(len(big) + 16)[0], runner.acquire(48)[0]]
                parts = [(prompt[:body], slot)] + ([(big, others[0]), (small, others[1])] if sharing else [])
                ids = torch.tensor([t for tokens, _ in parts for t in tokens], device=DEVICE)
                cache.reserve(body)
                fused.prefill(ids, [(0, len(tokens), s) for tokens, s in parts], runner.kv)
                slots.append((slot, others))
            (a, _), (b, others) = slots
            states = fused.states
            (ra, _), (rb, _) = states.buffers(a), states.buffers(b)
            same_states = bool(torch.equal(states.conv[:, ra], states.conv[:, rb])
                               and torch.equal(states.rec[:, ra], states.rec[:, rb]))
            rec_diff = float((states.rec[:, ra] - states.rec[:, rb]).abs().max())
            first_a = runner.run([(a, [prompt[-1]], body)]).logits[0].clone()
            first_b = runner.run([(b, [prompt[-1]], body)]).logits[0].clone()
            rows.append(dict(prompt_tokens=length, states_identical=same_states, largest_state_difference=rec_diff,
                             first_logits_identical=bool(torch.equal(first_a, first_b)),
                             first_token_agrees=int(first_a.argmax()) == int(first_b.argmax())))
            log(f"  [{elapsed():.0f}s] prefill sharing, {length} tokens: {rows[-1]}")
            for slot, others in slots:
                for s in [slot, *others]:
                    runner.pool.release(s)
        return rows

    def exact_mode(self, new_tokens: int) -> dict:
        """Speculative rounds (drafts from the plain continuation, every third chain spoiled) give
        the plain tokens, through the Engine: greedy and sampled, alone and batched."""
        engine = self.engine
        out = {}
        for temperature in (0.0, 0.8):
            prompts = [self.ids(min(300, self.contexts[0]) + 7 * i) for i in range(3)]
            plain = []
            for i, prompt in enumerate(prompts):
                session = engine.open(make_spec(prompt, new_tokens, temperature=temperature, seed=i))
                while len(session.token_ids) - len(prompt) < new_tokens:
                    engine.run_round(session, [], None, decode_ahead=True)
                plain.append(session.token_ids[len(prompt) : len(prompt) + new_tokens])
                engine.close(session)
            # alone
            alone_ok = 0
            for i, prompt in enumerate(prompts):
                session = engine.open(make_spec(prompt, new_tokens, temperature=temperature, seed=i))
                rounds = 0
                while len(session.token_ids) - len(prompt) < new_tokens:
                    done = len(session.token_ids) - len(prompt)
                    drafts = plain[i][done : done + 4]
                    if rounds % 3 == 1 and len(drafts) > 1:
                        drafts = [drafts[0], (drafts[1] + 1) % self.model.config.vocab_size, *drafts[2:]]
                    engine.run_round(session, drafts[: max(0, session.capacity_left)], None)
                    rounds += 1
                alone_ok += int(session.token_ids[len(prompt) : len(prompt) + new_tokens] == plain[i])
                engine.close(session)
            # batched
            from verifier_service.rounds import RoundRequest

            sessions = [engine.open(make_spec(p, new_tokens, temperature=temperature, seed=i))
                        for i, p in enumerate(prompts)]
            rounds = 0
            while any(len(s.token_ids) - len(p) < new_tokens for s, p in zip(sessions, prompts)):
                requests = []
                for i, (s, p) in enumerate(zip(sessions, prompts)):
                    done = len(s.token_ids) - len(p)
                    if done >= new_tokens:
                        continue
                    drafts = plain[i][done : done + 4] if (rounds + i) % 2 else []
                    if rounds % 3 == 1 and len(drafts) > 1:
                        drafts = [drafts[0], (drafts[1] + 1) % self.model.config.vocab_size, *drafts[2:]]
                    requests.append(RoundRequest(s, drafts[: max(0, s.capacity_left)]))
                engine.run_rounds(requests)
                rounds += 1
            batched_ok = sum(int(s.token_ids[len(p) : len(p) + new_tokens] == plain[i])
                             for i, (s, p) in enumerate(zip(sessions, prompts)))
            for s in sessions:
                engine.close(s)
            kind = "greedy" if temperature == 0 else "sampled"
            out[f"{kind}: alone identical (of 3)"] = alone_ok
            out[f"{kind}: batched identical (of 3)"] = batched_ok
            log(f"  [{elapsed():.0f}s] exact mode {kind}: alone {alone_ok}/3, batched {batched_ok}/3")
        return out

    # -- speed -----------------------------------------------------------------------------------

    def window_times(self, context: int, windows: list[int], steps: int) -> list[dict]:
        slot = self.prefill(self.ids(min(context, CHUNK)), context + 16) if context > CHUNK else self.prefill(self.ids(context))
        cache_len = context  # positions before the window (the KV of a long context need not be real to time it)
        rows = []
        floor_ms = step_bytes(self.model, context) / self.bandwidth * 1e3
        for num_rows in windows:
            self.runner.run([(slot, self.ids(num_rows), cache_len)])
            ms = replay_ms(self.runner.graphs[num_rows][0], steps)
            rows.append(dict(context=context, rows=num_rows, ms=ms, floor_ms=floor_ms))
        for r in rows:
            r["time_ratio"] = r["ms"] / rows[0]["ms"]
        log(f"  [{elapsed():.0f}s] context {context}: " + ", ".join(f"T={r['rows']} {r['ms']:.3f} ms" for r in rows)
            + f"; floor {floor_ms:.3f} ms")
        self.runner.pool.release(slot)
        return rows

    def distinct_experts(self, context: int, num_rows: int) -> float:
        """Mean distinct experts a window of num_rows rows routes to per MoE layer (eager run)."""
        import shared.model.families.hybrid.fused as hybrid

        slot = self.prefill(self.ids(context))
        seen = []
        original = hybrid.route

        def recording(*a, **k):
            ids, weights = original(*a, **k)
            seen.append(ids[:, :-1].clone())  # (the shared expert's route left out)
            return ids, weights

        hybrid.route = recording
        try:
            shape = (num_rows, 1, num_rows)
            self.runner.run([(slot, self.ids(num_rows), context)])  # fills the step's inputs
            self.runner.fused.forward(self.runner.inputs.on_device("token_ids", num_rows), self.runner._rows(shape),
                                      self.runner.kv)
        finally:
            hybrid.route = original
            self.runner.pool.release(slot)
        return statistics.mean(len(set(ids.reshape(-1).tolist())) for ids in seen)

    def batch_times(self, context: int, sizes: list[int], steps: int) -> list[dict]:
        c = self.model.config
        slots = [self.prefill(self.ids(context)) for _ in range(max(sizes))]
        rows = []
        for size in sizes:
            self.runner.run([(s, self.ids(1), context) for s in slots[:size]])
            ms = replay_ms(self.runner.last_graph(), steps)
            distinct = expected_distinct(c.num_experts, c.num_experts_per_tok, size)
            floor_ms = step_bytes(self.model, context, num_seqs=size, experts_read=distinct) / self.bandwidth * 1e3
            rows.append(dict(context=context, sequences=size, ms=ms, tokens_per_s=size / ms * 1e3, floor_ms=floor_ms,
                             expected_distinct_experts=distinct))
            log(f"  [{elapsed():.0f}s] decode batch {size}: {ms:.3f} ms ({size / ms * 1e3:.0f} tokens/s), "
                f"floor {floor_ms:.3f} ms")
        for s in slots:
            self.runner.pool.release(s)
        return rows

    def prefill_rate(self, length: int) -> float:
        prompt = self.ids(length)
        sync()
        started = time.perf_counter()
        slot = self.prefill(prompt)
        sync()
        seconds = time.perf_counter() - started
        self.runner.pool.release(slot)
        log(f"  [{elapsed():.0f}s] prefill {length} tokens: {seconds:.2f} s ({length / seconds:.0f} tokens/s)")
        return length / seconds


def run_raw(args) -> dict:
    """Each section in turn (a failing one is reported and the rest still run); the optional
    ones only while elapsed() < --budget-s. Results are written to --out after each section."""
    raw = Raw(args)
    res = raw.results
    windows = [int(w) for w in args.windows.split(",")]
    cuda = torch.cuda.is_available()
    first = raw.contexts[0]
    sections = [
        ("speed_first", cuda, lambda: raw.window_times(first, windows, args.steps)),
        ("reference_vs_fused", True, lambda: raw.against_reference(first, windows)),
        ("bit_identity", True, lambda: raw.bit_identity(first)),
        ("exact_mode", True, lambda: raw.exact_mode(args.exact_tokens)),
        ("distinct_experts", True, lambda: {t: raw.distinct_experts(first, t) for t in (1, 5)}),
        ("batches", cuda, lambda: raw.batch_times(first, [8, 32], args.steps)),
        ("speed", cuda, lambda: [r for c in raw.contexts[1:] for r in raw.window_times(c, windows, args.steps)]),
        ("prefill_tokens_per_s", cuda, lambda: {4096: raw.prefill_rate(4096)}),
        ("reference_vs_fused_long", True, lambda: [r for c in raw.contexts[1:] for r in raw.against_reference(c, [1, 5])]),
        ("prefill_long_tokens_per_s", cuda, lambda: {args.prefill: raw.prefill_rate(args.prefill)}),
        ("prefill_sharing", True, lambda: raw.prefill_sharing()),
    ]
    chosen = set(args.sections.split(",")) if args.sections else None
    for index, (name, wanted, section) in enumerate(sections):
        if chosen is not None and name not in chosen:
            continue
        if not wanted or (index >= 6 and elapsed() > args.budget_s):
            log(f"[{elapsed():.0f}s] skipped: {name}")
            continue
        try:
            res[name] = section()
        except Exception as error:  # (a broken section is a result too; the others still run)
            import traceback

            traceback.print_exc()
            res[name] = f"failed: {error!r}"
        if args.out:
            args.out.write_text(json.dumps(res, indent=1, default=str))
    return res


def rows_of(res: dict, *names: str) -> list[dict]:
    return [r for name in names if isinstance(res.get(name), list) for r in res[name]]


def report_raw(res: dict) -> None:
    print(f"copy bandwidth {res['bandwidth_tb_s']:.2f} TB/s\n")
    print("| context | rows T | ms | time(T)/time(1) | floor ms (T=1) | fraction of the floor (T=1) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows_of(res, "speed_first", "speed"):
        frac = r["floor_ms"] / r["ms"] if r["rows"] == 1 else float("nan")
        print(f"| {r['context']} | {r['rows']} | {r['ms']:.3f} | {r['time_ratio']:.2f} | {r['floor_ms']:.3f} | {frac:.3f} |")
    print(f"\ndistinct experts per MoE layer: {res.get('distinct_experts')}")
    print("\n| decode batch | ms | tokens/s | floor ms (expected distinct experts) | fraction |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows_of(res, "batches"):
        print(f"| {r['sequences']} | {r['ms']:.3f} | {r['tokens_per_s']:.0f} | {r['floor_ms']:.3f} "
              f"({r['expected_distinct_experts']:.0f}) | {r['floor_ms'] / r['ms']:.3f} |")
    print("\n| context | rows | logits rel err | hidden rel err | argmax agree | reference eager ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows_of(res, "reference_vs_fused", "reference_vs_fused_long"):
        print(f"| {r['context']} | {r['rows']} | {r['logits_rel_err']:.2e} | {r['hidden_rel_err']:.2e} "
              f"| {r['argmax_agree']:.2f} | {r['reference_ms']:.1f} |")
    print(f"\nbit identity: {res.get('bit_identity')}\nexact mode: {res.get('exact_mode')}")
    print(f"prefill tokens/s: {res.get('prefill_tokens_per_s')} {res.get('prefill_long_tokens_per_s')}")
    if rows_of(res, "prefill_sharing"):
        print("\n| prefill GEMMs | prompt tokens | states alone = shared | largest state difference | first logits identical "
              "| first token agrees |")
        print("| --- | ---: | --- | ---: | --- | --- |")
        for r in rows_of(res, "prefill_sharing"):
            if "prompt_tokens" in r:
                print(f"| {r['prefill_gemm']} | {r['prompt_tokens']} | {r['states_identical']} "
                      f"| {r['largest_state_difference']:.3g} | {r['first_logits_identical']} | {r['first_token_agrees']} |")
        for r in rows_of(res, "prefill_sharing"):
            if "tokens_per_s_4096" in r:
                print(f"\nprefill with {r['prefill_gemm']} GEMMs (median of 3, interleaved): one 4,096-token prompt "
                      f"{r['tokens_per_s_4096']:.0f} tokens/s, 8 prompts of 512 in one forward {r['tokens_per_s_8x512']:.0f}")


def run_accuracy(args) -> list[dict]:
    import copy

    from shared.model.families import build_fused
    from shared.model.rows import Rows
    from shared.model.kv_cache import KVPool
    from shared.model.families.hybrid.loader import random_next
    from shared.model.families.hybrid.config import NextConfig

    out = []
    for name, types in (("1 linear-attention layer", ["linear_attention"]), ("1 full-attention layer", ["full_attention"]),
                        ("4 layers", QWEN3_5_35B_A3B["layer_types"][:4])):
        shapes = QWEN3_5_35B_A3B | (SMALL if args.small else {}) | dict(num_hidden_layers=len(types), layer_types=types,
                                                                       max_position_embeddings=1024)
        config = replace(NextConfig.from_dict(shapes), mtp_num_hidden_layers=0)
        low = random_next(config, dtype=torch.bfloat16, device=DEVICE, parts="trunk")
        high = copy.deepcopy(low).float()
        ids = torch.randint(0, config.vocab_size, (517,), generator=torch.Generator().manual_seed(1)).to(DEVICE)

        def reference(model):
            cache = model.new_cache(540)
            model.prefill(ids[:512], cache)
            return model(ids[512:], cache, keep_states=True)[0].float()

        truth, ref = reference(high), reference(low)
        del high
        fused = build_fused(low, max_rows=8, max_length=1024, num_state_slots=1)
        pool = KVPool(num_layers=low.num_kv_layers, num_slots=1, max_length=1024, num_kv_heads=config.num_key_value_heads,
                      head_dim=config.head_dim, dtype=torch.bfloat16, device=DEVICE, block_size=64)
        slot, _ = pool.acquire(540)
        if fused.states is not None:
            fused.states.reset(slot)
        fused.prefill(ids[:512], [(0, 512, slot)], pool.paged())
        read, write = fused.states.buffers(slot) if fused.states is not None else (0, 0)
        rows = Rows.window(512, 5, slot, DEVICE)
        rows = Rows(**{**rows.__dict__, "state_in": torch.tensor([read], device=DEVICE),
                       "state_out": torch.tensor([write], device=DEVICE)})
        logits = fused.forward(ids[512:], rows, pool.paged())[0].float()
        out.append(dict(model=name, fused_vs_float32=rel_err(logits, truth), reference_vs_float32=rel_err(ref, truth),
                        fused_vs_reference=rel_err(logits, ref)))
        log(f"  [{elapsed():.0f}s] {out[-1]}")
        del low, fused, pool
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return out


def run_service(args) -> dict:
    from pairbench.services import Children

    from bench.serve_decode import client_decode
    from shared.client import GenerationConfig

    import asyncio

    workdir = Path(tempfile.mkdtemp(prefix="hybrid-service-"))
    model_dir = workdir / "model"
    model_dir.mkdir()
    shapes = QWEN3_5_35B_A3B | dict(max_position_embeddings=args.long_context + args.new_tokens + 64)
    (model_dir / "config.json").write_text(json.dumps(shapes))
    children = Children(workdir)
    port = free_port()
    out: dict = {}
    try:
        children.start("verifier", [sys.executable, "-m", "shared.cli", "verifier", "--model", str(model_dir),
                                    "--random-weights", "--device", "cuda", "--dtype", "bfloat16", "--port", str(port),
                                    "--max-sessions", "2", "--grace-s", "2"])
        address = f"127.0.0.1:{port}"
        asyncio.run(children.wait_serving("verifier", address, timeout=400))
        out["startup_s"] = elapsed()
        log(f"[{elapsed():.0f}s] service up")
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, shapes["vocab_size"], (args.long_context,), generator=gen).tolist()
        client_decode(address, prompt[:32], GenerationConfig(max_new_tokens=8))  # warm-up
        greedy = []
        for block in range(args.blocks):
            r = client_decode(address, prompt[block * 7 : block * 7 + 512],
                              GenerationConfig(max_new_tokens=args.new_tokens, temperature=0.0, speculation=False))
            greedy.append(r)
            log(f"  [{elapsed():.0f}s] greedy, context 512: {r['decode_tokens_per_s']:.1f} tokens/s, TTFT {r['ttft_ms']:.0f} ms")
        out["greedy_512"] = [{k: v for k, v in r.items() if k != "token_ids"} for r in greedy]
        r = client_decode(address, prompt[:512], GenerationConfig(max_new_tokens=args.new_tokens, temperature=0.8,
                                                                  top_p=0.95, seed=3, speculation=False))
        out["sampled_512"] = {k: v for k, v in r.items() if k != "token_ids"}
        log(f"  [{elapsed():.0f}s] sampled, context 512: {r['decode_tokens_per_s']:.1f} tokens/s")
        r = client_decode(address, prompt, GenerationConfig(max_new_tokens=args.new_tokens, temperature=0.0,
                                                            speculation=False))
        out["greedy_long"] = {k: v for k, v in r.items() if k != "token_ids"}
        log(f"  [{elapsed():.0f}s] greedy, context {args.long_context}: {r['decode_tokens_per_s']:.1f} tokens/s, "
            f"TTFT {r['ttft_ms']:.0f} ms")
    finally:
        children.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=("raw", "accuracy", "service"), required=True)
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--contexts", default="512,4096,32768")
    parser.add_argument("--windows", default="1,2,3,5,9")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prefill", type=int, default=32768)
    parser.add_argument("--exact-tokens", type=int, default=24)
    parser.add_argument("--budget-s", type=float, default=330.0, help="raw: skip the optional sections past this")
    parser.add_argument("--sections", default="", help="raw: only these sections (comma-separated names)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--long-context", type=int, default=32768)
    parser.add_argument("--small", action="store_true", help="raw: small shapes (a smoke test; on a CPU box too)")
    parser.add_argument("--bf16", action="store_true", help="raw on the CPU: bfloat16 weights (the GPU always is)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
    print(f"### hybrid fused path, {args.part}: {time.strftime('%Y-%m-%d')}, {device}, "
          f"Qwen3.5-35B-A3B shapes, bf16, random weights\n")
    if args.part == "raw":
        res = run_raw(args)
        if args.out:
            args.out.write_text(json.dumps(res, indent=1, default=str))
        report_raw(res)
    elif args.part == "accuracy":
        res = run_accuracy(args)
        print("| model (real widths, window of 5 after 512 tokens) | fused bf16 vs float32 | reference bf16 vs float32 "
              "| fused vs reference |")
        print("| --- | ---: | ---: | ---: |")
        for r in res:
            print(f"| {r['model']} | {r['fused_vs_float32']:.2e} | {r['reference_vs_float32']:.2e} "
                  f"| {r['fused_vs_reference']:.2e} |")
    else:
        res = run_service(args)
        if args.out:
            args.out.write_text(json.dumps(res, indent=1, default=str))
        print(json.dumps(res, indent=1, default=str))
    gc.collect()


if __name__ == "__main__":
    main()
