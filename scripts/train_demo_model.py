"""Train the demo `qwen3_moe` checkpoint (trunk + MTP layer) from scratch on Python source.

Pipeline (each phase timed and printed): scan *.py files under --roots (sorted, UTF-8,
<= 200 kB, deduplicated by content) and hold out every file whose top-level package is in
HELD_OUT (demo_model/corpus.py); train a byte-level BPE tokenizer on (a bounded subset of)
the train split; pack the train docs, separated by <|endoftext|> (id 0), into one token
stream; train a differentiable twin of shared.model (same math, same checkpoint names) with
next-token, MTP (token after next) and router load-balancing losses for a wall-clock budget;
save a bf16 checkpoint; reload it with shared.model.load_model and evaluate on the held-out
files; write metrics.json and a README.md model card (re-render with --card-only). This file
parses the arguments and runs the phases; their code lives in scripts/demo_model/.

    python scripts/train_demo_model.py                  # GPU run, ~10 minutes in all
    python scripts/train_demo_model.py --smoke --out /tmp/demo_smoke   # CPU, < 2 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import sys
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:  # demo_model: also when not run as `python scripts/train_demo_model.py`
    sys.path.insert(0, str(HERE))

# the run clock (T0) starts on this import, before the heavy imports: --total-minutes counts them
from demo_model.common import T0, log, write_json

sys.path.insert(0, str(REPO))  # shared

import numpy as np
import torch
from demo_model.card import render_card
from demo_model.corpus import (
    EOS,
    encode,
    pack_stream,
    scan_corpus,
    tokenizer_subset,
    train_tokenizer,
)
from demo_model.evaluate import run_evaluation
from demo_model.train import train
from demo_model.twin import (
    Twin,
    init_weights,
    model_config,
    param_counts,
    save_checkpoint_dir,
)

from shared.model import ModelConfig

MAX_CHECKPOINT_BYTES = 24_000_000


def parse_args() -> argparse.Namespace:
    paths = sysconfig.get_paths()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    arg = ap.add_argument
    arg("--roots", nargs="+", default=list(dict.fromkeys([paths["stdlib"], paths["purelib"]])))
    arg("--out", default=str(REPO / "models" / "tandem-demo-moe"))
    arg("--vocab-size", type=int, default=4096)
    arg("--tokenizer-mb", type=float, default=40.0, help="train text used to fit the tokenizer")
    arg("--max-train-mb", type=float, default=200.0, help="train text tokenized for the stream")
    arg("--max-files", type=int, default=0, help="cap on train files (0 = all)")
    for name, value in (("hidden", 256), ("layers", 4), ("heads", 4), ("kv-heads", 2), ("head-dim", 64),
                        ("experts", 16), ("top-k", 2), ("moe-intermediate", 128), ("intermediate", 512)):
        arg(f"--{name}", type=int, default=value)
    arg("--seq-len", type=int, default=512)
    arg("--batch-size", type=int, default=64)
    arg("--lr", type=float, default=3e-3)
    arg("--warmup", type=int, default=200)
    arg("--weight-decay", type=float, default=0.1)
    arg("--grad-clip", type=float, default=1.0)
    arg("--mtp-weight", type=float, default=0.3)
    arg("--aux-coef", type=float, default=0.01)
    arg("--max-minutes", type=float, default=8.0, help="training wall-clock budget")
    arg("--total-minutes", type=float, default=9.3,
        help="whole-run deadline: training stops early to leave --eval-reserve-s before it")
    arg("--eval-reserve-s", type=float, default=35.0, help="seconds kept for saving and evaluation")
    arg("--max-steps", type=int, default=0, help="0 = until the time budget")
    arg("--log-every", type=int, default=100)
    arg("--eval-tokens", type=int, default=200_000)
    arg("--eval-train-tokens", type=int, default=50_000)
    arg("--eval-chunk", type=int, default=1024)
    arg("--seed", type=int, default=0)
    arg("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    arg("--compile", action="store_true", help="torch.compile the loss function")
    arg("--smoke", action="store_true", help="tiny CPU settings (stdlib root, 300 files, 30 steps)")
    arg("--card-only", action="store_true", help="re-render README.md from --out/metrics.json")
    args = ap.parse_args()
    if args.smoke:
        explicit = set(sys.argv)
        smoke = {"roots": [paths["stdlib"]], "max_files": 300, "vocab_size": 512, "tokenizer_mb": 2.0, "hidden": 64,
                 "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16, "experts": 4, "moe_intermediate": 32,
                 "intermediate": 128, "seq_len": 64, "batch_size": 8, "warmup": 5, "max_steps": 30, "max_minutes": 1.0,
                 "log_every": 5, "eval_tokens": 4000, "eval_train_tokens": 1000, "eval_chunk": 256}
        for key, value in smoke.items():
            if "--" + key.replace("_", "-") not in explicit:
                setattr(args, key, value)
    return args


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    if args.card_only:
        (out / "README.md").write_text(render_card(json.loads((out / "metrics.json").read_text())))
        log(f"wrote {out / 'README.md'}")
        return
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device, timings = torch.device(args.device), {}
    out.mkdir(parents=True, exist_ok=True)

    log(f"scanning corpus under {args.roots}")
    t = time.time()
    train_texts, held_texts, corpus = scan_corpus([Path(r) for r in args.roots], args)
    tok_texts, corpus["tokenizer_train_bytes"] = tokenizer_subset(train_texts, args.tokenizer_mb)
    timings["scan_s"] = round(time.time() - t, 1)
    log(f"corpus: {corpus['files_found']} files; train {corpus['train_files']} files ({corpus['train_bytes']:,} B) "
        f"of {corpus['train_candidate_files']} ({corpus['train_candidate_bytes']:,} B); held-out "
        f"{corpus['heldout_files']} ({corpus['heldout_bytes']:,} B) {corpus['heldout_packages']}; skipped "
        f"{corpus['skipped']}")
    if corpus["heldout_missing"]:
        log(f"WARNING: held-out packages not found: {corpus['heldout_missing']}")

    log(f"training tokenizer (vocab {args.vocab_size}) on {len(tok_texts)} files, "
        f"{corpus['tokenizer_train_bytes']:,} B")
    t = time.time()
    tok = train_tokenizer(tok_texts, args.vocab_size)
    tok.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS,
                                               "bos_token": None, "model_max_length": 2048})
    timings["tokenizer_s"] = round(time.time() - t, 1)

    log(f"tokenizing {len(train_texts)} train + {len(held_texts)} held-out files")
    t = time.time()
    train_docs, held_docs = encode(tok, train_texts), encode(tok, held_texts)
    stream_np = pack_stream(train_docs)
    corpus.update(train_tokens=int(stream_np.size), heldout_tokens=int(sum(d.size for d in held_docs)),
                  train_bytes_per_token=round(corpus["train_bytes"] / stream_np.size, 3))
    stream = torch.from_numpy(stream_np).to(device)
    timings["tokenize_s"] = round(time.time() - t, 1)
    log(f"stream: {stream_np.size:,} train tokens ({corpus['train_bytes_per_token']} B/token), "
        f"{corpus['heldout_tokens']:,} held-out tokens")

    hf = model_config(args, tok.get_vocab_size())
    config = ModelConfig.from_dict(hf)
    torch.manual_seed(args.seed)
    twin = Twin(config)
    init_weights(twin, config)
    twin.to(device)
    params = param_counts(twin, config)
    log(f"training: {params['total']:,} parameters, {params['active_per_token']:,} active per token; "
        f"budget {args.max_minutes} min on {device}")
    t = time.time()
    training = train(twin, stream, args, device)
    timings["train_s"] = round(time.time() - t, 1)
    log(f"trained {training['steps']} steps, {training['tokens_seen']:,} tokens in {training['wall_s']} s")
    size = save_checkpoint_dir(out, twin, hf)
    log(f"saved {out} (model.safetensors {size:,} bytes = {size / 1e6:.2f} MB)")

    log("evaluating the saved checkpoint with shared.model.load_model")
    t = time.time()
    evaluation = run_evaluation(out, twin, held_docs, train_docs, args, device)
    timings["eval_s"] = round(time.time() - t, 1)
    timings["total_s"] = round(time.time() - T0, 1)
    cpu = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    metrics = {
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]), "args": vars(args),
        "torch_version": torch.__version__, "python_version": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
        "corpus": corpus, "architecture": hf, "parameters": params, "checkpoint_bytes": size,
        "training": training, "evaluation": evaluation, "timings": timings,
    }
    write_json(out / "metrics.json", metrics)
    (out / "README.md").write_text(render_card(metrics))
    log(f"wrote metrics.json and README.md; timings {timings}")
    assert size <= MAX_CHECKPOINT_BYTES, f"model.safetensors is {size:,} bytes > {MAX_CHECKPOINT_BYTES:,}"


if __name__ == "__main__":
    main()
