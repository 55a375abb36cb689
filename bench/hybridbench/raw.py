"""`--part raw` of bench/hybrid_fast.py: one trunk in this process, the verifier's Engine on it
(fused path, CUDA graphs) and the reference modules on the same weights: correctness, bit
identity, exact mode, speed against the floor, prefill."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import replace

import torch
from hybridbench.common import (CHUNK, DEVICE, SMALL, elapsed, expected_distinct, rel_err, replay_ms, step_bytes,
                                sync)
from pairbench.common import QWEN3_5_35B_A3B, log, request_spec

from bench.model_baseline import copy_bandwidth

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
                session = engine.open(request_spec(prompt, new_tokens, temperature=temperature, seed=i))
                while len(session.token_ids) - len(prompt) < new_tokens:
                    engine.run_round(session, [], None, decode_ahead=True)
                plain.append(session.token_ids[len(prompt) : len(prompt) + new_tokens])
                engine.close(session)
            # alone
            alone_ok = 0
            for i, prompt in enumerate(prompts):
                session = engine.open(request_spec(prompt, new_tokens, temperature=temperature, seed=i))
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

            sessions = [engine.open(request_spec(p, new_tokens, temperature=temperature, seed=i))
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
