"""The training loop: AdamW with warmup and a cosine schedule over a wall-clock budget (or --max-steps),
random windows of the packed token stream, loss = CE + w CE_mtp + c Σ_layers load balance."""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import Tensor

from .common import T0, log
from .twin import Twin, compute_losses


def _stop(start: float, budget: float, step: int, args: argparse.Namespace) -> bool:
    return time.time() - start >= budget or bool(args.max_steps and step >= args.max_steps)


def train(twin: Twin, stream: Tensor, args: argparse.Namespace, device: torch.device) -> dict:
    decay = [p for p in twin.parameters() if p.dim() >= 2]
    no_decay = [p for p in twin.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda",
    )
    loss_fn = torch.compile(compute_losses) if args.compile else compute_losses
    gen = torch.Generator().manual_seed(args.seed)
    span = torch.arange(args.seq_len + 2, device=device)
    left = args.total_minutes * 60.0 - (time.time() - T0) - args.eval_reserve_s  # whole-run deadline
    budget, curve, step = max(1.0, min(args.max_minutes * 60.0, left)), [], 0
    if budget < args.max_minutes * 60.0:
        log(f"training budget cut to {budget:.0f} s by --total-minutes {args.total_minutes}")
    sums = torch.zeros(3, device=device)
    start = time.time()
    while not _stop(start, budget, step, args):
        # With --max-steps the schedule follows steps (reproducible on any GPU); otherwise
        # the elapsed fraction of the time budget (the step count is unknown in advance).
        frac = step / args.max_steps if args.max_steps else (time.time() - start) / budget
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, stream.numel() - args.seq_len - 2, (args.batch_size,), generator=gen).to(device)
        batch = stream[offsets[:, None] + span].long()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            ce, ce_mtp, aux = loss_fn(twin, batch)
        loss = ce + args.mtp_weight * ce_mtp + args.aux_coef * (args.layers + 1) * aux
        loss.backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sums += torch.stack([ce.detach(), ce_mtp.detach(), aux.detach()])
        step += 1
        window = step - (curve[-1]["step"] if curve else 0)
        if window == args.log_every or (window and _stop(start, budget, step, args)):
            ce_v, mtp_v, aux_v = (sums / window).tolist()  # means over the window (syncs)
            sums.zero_()
            row = {"step": step, "elapsed_s": round(time.time() - start, 1),
                   "tokens": step * args.batch_size * args.seq_len, "loss": round(ce_v, 4),
                   "mtp_loss": round(mtp_v, 4), "aux_loss": round(aux_v, 4), "lr": round(lr, 6)}
            curve.append(row)
            log("train " + " ".join(f"{k}={v}" for k, v in row.items()))
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.time() - start
    tokens = step * args.batch_size * args.seq_len
    return {"steps": step, "tokens_seen": tokens, "wall_s": round(wall, 1), "budget_s": round(budget, 1),
            "tokens_per_s": round(tokens / max(wall, 1e-9)),
            "epochs": round(tokens / stream.numel(), 3), "loss_curve": curve,
            "final_train_loss": curve[-1]["loss"] if curve else None,
            "final_mtp_loss": curve[-1]["mtp_loss"] if curve else None,
            "final_aux_loss": curve[-1]["aux_loss"] if curve else None}
