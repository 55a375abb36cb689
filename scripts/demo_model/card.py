"""The README.md model card, rendered from metrics.json alone (so --card-only can re-render it)."""

from __future__ import annotations

import math
import shlex

SCRIPT = "scripts/train_demo_model.py"


def reproduce_command(m: dict) -> str:
    """The recorded command, run from the repo root, with --max-steps pinned to the trained step count.

    metrics["command"] holds the arguments given on the command line (everything else was a default);
    they are kept, except --max-steps (replaced) and --card-only.
    """
    argv, kept, skip = shlex.split(m["command"])[2:], [], False  # drop "python" and the script path
    for arg in argv:
        name = arg.split("=", 1)[0]
        if skip or name == "--card-only":
            skip = False
            continue
        if name.startswith("--max-s") and "--max-steps".startswith(name):  # argparse accepts prefixes
            skip = "=" not in arg
            continue
        kept.append(arg)
    return shlex.join(["python", SCRIPT, *kept, "--max-steps", str(m["training"]["steps"])])


def render_card(m: dict) -> str:
    """The README.md model card, from metrics.json alone."""
    c, a, p, t, e, args = m["corpus"], m["architecture"], m["parameters"], m["training"], m["evaluation"], m["args"]
    h, curve = e["heldout"], t["loss_curve"]
    shown = curve[:: max(1, math.ceil(len(curve) / 25))]
    shown += curve[-1:] if curve and shown[-1] is not curve[-1] else []
    roots = [f"- `{r}`: {v['train_files']} train files, {v['heldout_files']} held-out files"
             for r, v in c["per_root"].items()]
    blocks = [
        "# tandem-demo-moe",
        ("A small `qwen3_moe` checkpoint with one MTP layer (Qwen3-Next naming), trained from scratch on Python "
         "source by `scripts/train_demo_model.py`: a demo model for tandem's speculative decoding (tiny, fast, "
         "reproducible), not a useful code model."),
        "## Corpus",
        "\n".join([*roots,
                   (f"- train split: {c['train_candidate_files']} candidate files, {c['train_candidate_bytes']:,} "
                    f"bytes; read in a fixed-seed shuffled order up to the cap: {c['train_files']} files, "
                    f"{c['train_bytes']:,} bytes = {c['train_tokens']:,} tokens ({c['train_bytes_per_token']} "
                    f"bytes/token); tokenizer fitted on the first {c['tokenizer_train_bytes']:,} bytes of them"),
                   (f"- {c['files_found']} *.py files found; skipped: {c['skipped']} (UTF-8 only, "
                    "<= 200 kB, deduplicated by content hash)")]),
        "## Held-out set",
        (f"Every file whose top-level package under its root is one of {', '.join(c['heldout_names'])} (missing: "
         f"{c['heldout_missing'] or 'none'}); never trained on and not seen by the tokenizer: {c['heldout_files']} "
         f"files, {c['heldout_bytes']:,} bytes, by package {c['heldout_packages']}. Evaluated on {h['tokens']:,} "
         f"tokens in {h['chunks']} chunks of <= {args['eval_chunk']} tokens (each file starts with token 0)."),
        "## Architecture",
        (f"hidden {a['hidden_size']}, {a['num_hidden_layers']} layers (all MoE), {a['num_attention_heads']} heads / "
         f"{a['num_key_value_heads']} KV heads of dim {a['head_dim']}, {a['num_experts']} routed experts, top-"
         f"{a['num_experts_per_tok']} (moe_intermediate {a['moe_intermediate_size']}, norm_topk_prob "
         f"{a['norm_topk_prob']}), vocab {a['vocab_size']} (byte-level BPE, `<|endoftext|>` = 0 = eos), tied "
         f"embeddings, RoPE theta {a['rope_theta']}, one MTP layer (MoE). bf16 safetensors: "
         f"{m['checkpoint_bytes']:,} bytes."),
        "## Parameters",
        (f"{p['total']:,} in all ({p['trunk']:,} trunk + {p['mtp_layer']:,} MTP layer; {p['embedding_tied']:,} in "
         f"the tied embedding); {p['active_per_token']:,} active per token ({p['active_per_token_trunk']:,} in the "
         "trunk alone)."),
        "## Training",
        (f"{t['steps']:,} steps, {t['tokens_seen']:,} tokens ({t['epochs']} passes over the stream) in "
         f"{t['wall_s']} s on {m['device']} ({t['tokens_per_s']:,} tokens/s), torch {m['torch_version']}. AdamW lr "
         f"{args['lr']} (warmup {args['warmup']} steps, cosine to 10% over the time budget), weight decay "
         f"{args['weight_decay']}, batch {args['batch_size']} x {args['seq_len']} tokens; loss = CE + "
         f"{args['mtp_weight']} CE_mtp + {args['aux_coef']} Σ_layers load-balance."),
        "\n".join(["| step | elapsed s | tokens | train loss | MTP loss | aux (1 = balanced) |",
                   "|---|---|---|---|---|---|",
                   *[f"| {r['step']} | {r['elapsed_s']} | {r['tokens']:,} | {r['loss']} | {r['mtp_loss']} | "
                     f"{r['aux_loss']} |" for r in shown]]),
        "## Results",
        "\n".join([
            (f"- final train loss (mean of the last logged window of <= {args['log_every']} steps): "
             f"{t['final_train_loss']}; MTP loss {t['final_mtp_loss']}"),
            (f"- train sample, through the inference code: loss {e['train_sample']['loss']:.4f}, MTP loss "
             f"{e['train_sample']['mtp_loss']:.4f}"),
            f"- held-out loss {h['loss']:.4f} nats/token; held-out MTP loss {h['mtp_loss']:.4f}"]),
        "\n".join(["| held-out metric | value |", "|---|---|",
                   f"| trunk next-token top-1 accuracy | {h['top1_accuracy']:.4f} |",
                   f"| MTP top-1 agreement with token i+2 | {h['mtp_top1_agreement']:.4f} |",
                   f"| suffix match >= 3: correct / all positions | {h['suffix3_precision_all_positions']:.4f} |",
                   f"| suffix match >= 3: coverage | {h['suffix3_coverage']:.4f} |",
                   f"| suffix match >= 3: precision when predicting | {h['suffix3_precision_when_predicted']:.4f} |"]),
        f"Expert usage entropy on held-out tokens (top-k selections, bits; max {math.log2(a['num_experts']):g}):",
        "\n".join(["| MoE layer | entropy bits |", "|---|---|",
                   *[f"| {name} | {v['entropy_bits']} |" for name, v in h["expert_usage"].items()]]),
        f"Checkpoint parity (training twin vs the loaded checkpoint, fp32): {e['parity']}.",
        "## Reproduce",
        f"From the repository root:\n\n```\n{reproduce_command(m)}\n```",
        (f"`--max-steps` fixes the step count at this checkpoint's {t['steps']:,}. Without it a run stops on its "
         f"wall-clock training budget (`--max-minutes`, 8 minutes by default; {t['budget_s']:g} s for this run, "
         f"which was `{m['command']}` on {m['device']}), so its step count depends on the GPU's speed. The budget "
         "still applies as a safety limit (raise `--max-minutes` / `--total-minutes` on a slower GPU). With "
         "`--max-steps` the learning-rate schedule follows the step fraction; this run's followed the elapsed "
         "fraction of its time budget, which at its steady ~38 ms/step is the same curve to within rounding. "
         "The corpus is read from the roots listed under Corpus (by default "
         "the running interpreter's stdlib and site-packages; pass `--roots` to change them). Seeds are fixed, but "
         "GPU kernels are not bitwise deterministic, so a rerun matches these numbers closely, not bit for bit."),
    ]
    return "\n\n".join(blocks) + "\n"
