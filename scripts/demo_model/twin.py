"""Training twin of shared.model: same math, same checkpoint names, but differentiable and batched.

The twin's modules, their init, the training losses (next token, MTP token after next, router load
balance), the HF-style config, the bf16 export under checkpoint names, and the parameter counts.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shared.model import ModelConfig
from shared.model.layers import RMSNorm, Rotary

from .common import write_json


class AttentionTwin(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        h, d = c.hidden_size, c.head_dim
        self.nh, self.nkv, self.d = c.num_attention_heads, c.num_key_value_heads, d
        self.q_proj, self.o_proj = nn.Linear(h, self.nh * d, bias=False), nn.Linear(self.nh * d, h, bias=False)
        self.k_proj, self.v_proj = nn.Linear(h, self.nkv * d, bias=False), nn.Linear(h, self.nkv * d, bias=False)
        self.q_norm, self.k_norm = RMSNorm(d, c.rms_norm_eps), RMSNorm(d, c.rms_norm_eps)

    def forward(self, x: Tensor, rotary: Rotary, positions: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = rotary(self.q_norm(self.q_proj(x).view(b, t, self.nh, self.d)), positions)  # q/k norm, then RoPE
        k = rotary(self.k_norm(self.k_proj(x).view(b, t, self.nkv, self.d)), positions)
        v = self.v_proj(x).view(b, t, self.nkv, self.d)
        q, k, v = (z.transpose(1, 2).to(v.dtype) for z in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.nh != self.nkv)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.d))


class ExpertsTwin(nn.Module):
    """Stacked experts in nn.Linear layout; exported as experts.E.{gate,up,down}_proj.weight."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.gate_proj, self.up_proj = nn.Parameter(torch.empty(e, i, h)), nn.Parameter(torch.empty(e, i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))


class MoeTwin(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = ExpertsTwin(c)
        self.k, self.normalize = c.num_experts_per_tok, c.norm_topk_prob

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Dense all-expert SwiGLU weighted by a sparse [N, E] routing matrix (k nonzeros per row)."""
        shape, (e, i, h) = x.shape, self.experts.gate_proj.shape
        x = x.reshape(-1, h)
        probs = torch.softmax(F.linear(x, self.gate.weight).float(), dim=-1)  # router in float32
        top_w, top_i = probs.topk(self.k, dim=-1)  # weights from the unboosted probabilities
        if self.normalize:
            top_w = top_w / top_w.sum(-1, keepdim=True).clamp_min(2.0**-14)
        weights = torch.zeros_like(probs).scatter(1, top_i, top_w)
        chosen = torch.zeros_like(probs).scatter(1, top_i, 1.0)
        aux = e * ((chosen.mean(0) / self.k) * probs.mean(0)).sum()  # Switch load balance E·Σ f_e P_e
        ex = self.experts
        gate_up = F.linear(x, torch.cat([ex.gate_proj, ex.up_proj], dim=1).reshape(e * 2 * i, h)).view(-1, e, 2 * i)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up * weights.unsqueeze(-1).to(gate.dtype)
        out = F.linear(act.reshape(-1, e * i), ex.down_proj.permute(1, 0, 2).reshape(h, e * i))
        return out.view(shape), aux


class LayerTwin(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.self_attn, self.mlp = AttentionTwin(c), MoeTwin(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: Tensor, rotary: Rotary, positions: Tensor) -> tuple[Tensor, Tensor]:
        x = x + self.self_attn(self.input_layernorm(x), rotary, positions)
        out, aux = self.mlp(self.post_attention_layernorm(x))
        return x + out, aux


class Twin(nn.Module):
    """`model.*` trunk + `mtp.*` layer; tied lm_head = model.embed_tokens.weight."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        h = c.hidden_size
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, h)
        self.model.layers = nn.ModuleList([LayerTwin(c) for _ in range(c.num_hidden_layers)])
        self.model.norm = RMSNorm(h, c.rms_norm_eps)
        self.mtp = nn.Module()
        self.mtp.fc = nn.Linear(2 * h, h, bias=False)
        self.mtp.pre_fc_norm_embedding = RMSNorm(h, c.rms_norm_eps)
        self.mtp.pre_fc_norm_hidden = RMSNorm(h, c.rms_norm_eps)
        self.mtp.layers = nn.ModuleList([LayerTwin(c)])
        self.mtp.norm = RMSNorm(h, c.rms_norm_eps)
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.max_position_embeddings)  # non-persistent buffers

    def trunk(self, ids: Tensor) -> tuple[Tensor, list[Tensor]]:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x, auxes = self.model.embed_tokens(ids), []
        for layer in self.model.layers:
            x, aux = layer(x, self.rotary, positions)
            auxes.append(aux)
        return self.model.norm(x), auxes

    def mtp_forward(self, hidden: Tensor, next_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Row i: final-norm hidden h_i and token i+1 → MTP hidden predicting token i+2."""
        embedded = self.mtp.pre_fc_norm_embedding(self.model.embed_tokens(next_ids))
        x = self.mtp.fc(torch.cat([embedded, self.mtp.pre_fc_norm_hidden(hidden)], dim=-1))
        x, aux = self.mtp.layers[0](x, self.rotary, torch.arange(x.shape[1], device=x.device))
        return self.mtp.norm(x), aux

    def logits(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.model.embed_tokens.weight)


def init_weights(twin: Twin, c: ModelConfig) -> None:
    out_std = c.initializer_range / math.sqrt(2 * (c.num_hidden_layers + 1))
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, out_std if name.endswith(("o_proj.weight", "down_proj")) else c.initializer_range)


def compute_losses(twin: Twin, batch: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """batch [B, T+2] → (next-token CE, MTP CE (token i+2), mean per-layer load-balance loss)."""
    inp, nxt, nxt2 = batch[:, :-2], batch[:, 1:-1], batch[:, 2:]
    hidden, auxes = twin.trunk(inp)
    mtp_hidden, mtp_aux = twin.mtp_forward(hidden, nxt)
    vocab = twin.model.embed_tokens.num_embeddings
    ce = F.cross_entropy(twin.logits(hidden).float().view(-1, vocab), nxt.reshape(-1))
    ce_mtp = F.cross_entropy(twin.logits(mtp_hidden).float().view(-1, vocab), nxt2.reshape(-1))
    return ce, ce_mtp, torch.stack(auxes + [mtp_aux]).mean()


def export_tensors(twin: Twin) -> dict[str, Tensor]:
    """Checkpoint names: the state dict, with stacked experts split per expert (bf16)."""
    tensors = {}
    for name, t in twin.state_dict().items():
        t = t.detach().to("cpu", torch.bfloat16)
        prefix, kind = name.rsplit(".", 1)
        if prefix.endswith(".mlp.experts"):
            tensors.update({f"{prefix}.{e}.{kind}.weight": t[e].clone() for e in range(t.shape[0])})
        else:
            tensors[name] = t.contiguous()
    return tensors


def param_counts(twin: Twin, c: ModelConfig) -> dict[str, int]:
    total = sum(p.numel() for p in twin.parameters())
    per_expert = 3 * c.hidden_size * c.moe_intermediate_size
    moe_layers = c.num_hidden_layers + 1
    mtp = sum(p.numel() for p in twin.mtp.parameters())
    inactive = c.num_experts - c.num_experts_per_tok  # routed experts a token does not use, per layer
    return {
        "total": total, "trunk": total - mtp, "mtp_layer": mtp,
        "embedding_tied": twin.model.embed_tokens.weight.numel(),
        "routed_experts": moe_layers * c.num_experts * per_expert,
        "active_per_token": total - moe_layers * inactive * per_expert,
        "active_per_token_trunk": total - mtp - c.num_hidden_layers * inactive * per_expert,
    }


def model_config(args: argparse.Namespace, vocab_size: int) -> dict:
    """The HF-style config.json dict, round-tripped through our ModelConfig."""
    raw = {
        "model_type": "qwen3_moe", "vocab_size": vocab_size, "hidden_size": args.hidden,
        "num_hidden_layers": args.layers, "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim, "intermediate_size": args.intermediate,
        "moe_intermediate_size": args.moe_intermediate, "num_experts": args.experts,
        "num_experts_per_tok": args.top_k, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": True,
        "mtp_num_hidden_layers": 1, "initializer_range": 0.02, "eos_token_id": 0,
    }
    return {**ModelConfig.from_dict(raw).to_dict(), "bos_token_id": None, "torch_dtype": "bfloat16"}


def save_checkpoint_dir(out: Path, twin: Twin, hf: dict) -> int:
    from safetensors.torch import save_file

    save_file(export_tensors(twin), str(out / "model.safetensors"), metadata={"format": "pt"})
    write_json(out / "config.json", hf)
    write_json(out / "generation_config.json",
               {"eos_token_id": 0, "bos_token_id": None, "max_new_tokens": 128, "do_sample": False})
    return (out / "model.safetensors").stat().st_size
