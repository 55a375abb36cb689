"""The Qwen3-MoE trunk and its MTP layer (DESIGN §6).

The trunk runs a window of new tokens against a preallocated KV cache and returns logits
rows and final-norm hidden rows. The MTP layer (Qwen3-Next naming) predicts the token after
next: x = fc(cat([norm_e(embed(token)), norm_h(h)])) → one decoder layer → mtp.norm →
lm_head, where h is the trunk's final-norm hidden state; it has its own KV cache, and
multi-step drafting feeds its own output hidden state back in.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from shared.model.families.qwen3_moe.config import ModelConfig
from shared.model.kv_cache import KVCache
from shared.model.families.qwen3_moe.layers import DecoderLayer
from shared.model.layers import RMSNorm, Rotary, RoutingOptions
from shared.model.mtp import MTPLayer


class Qwen3MoeModel(nn.Module):
    def __init__(self, config: ModelConfig, *, trunk: bool = True) -> None:
        """trunk=False: the embeddings, the MTP layer and lm_head only (a lean drafter)."""
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.layers = nn.ModuleList(
            [DecoderLayer(config, dense=config.is_dense_layer(i)) for i in range(config.num_hidden_layers) if trunk]
        )
        self.norm = RMSNorm(h, config.rms_norm_eps) if trunk else None
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.mtp = MTPLayer(h, config.rms_norm_eps, norm=RMSNorm, layer=DecoderLayer(config, dense=False)) \
            if config.has_mtp else None
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.max_position_embeddings)

    # -- caches ---------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def _cache(self, num_layers: int, max_length: int) -> KVCache:
        if max_length > self.config.max_position_embeddings:
            raise ValueError(
                f"cache length {max_length} exceeds max_position_embeddings {self.config.max_position_embeddings}"
            )
        c = self.config
        return KVCache(
            num_layers=num_layers, max_length=max_length, num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim, dtype=self.dtype, device=self.device,
        )

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep KV rows (every trunk layer)."""
        return len(self.layers)

    def new_cache(self, max_length: int) -> KVCache:
        """A trunk KV cache for one sequence of up to max_length tokens."""
        if not self.layers:
            raise ValueError("this model was loaded without its trunk (a lean drafter's MTP layer only)")
        return self._cache(self.config.num_hidden_layers, max_length)

    def new_mtp_cache(self, max_length: int) -> KVCache:
        self._require_mtp()
        return self._cache(1, max_length)

    def _require_mtp(self) -> MTPLayer:
        if self.mtp is None:
            raise ValueError("this checkpoint has no MTP layer (config mtp_num_hidden_layers = 0, no mtp.* tensors)")
        return self.mtp

    # -- forward --------------------------------------------------------------------------

    def _window(self, cache: KVCache, num_rows: int, positions: Tensor | None) -> tuple[Tensor, int | None]:
        if positions is None:  # eager: positions and the visible length are known on the host
            start = cache.reserve(num_rows)
            return torch.arange(start, start + num_rows, device=self.device), start + num_rows
        return positions, None  # static shapes: caller tracks cache.length

    @torch.inference_mode()
    def forward(
        self,
        token_ids: Tensor,  # [T] int64
        cache: KVCache,
        *,
        routing: RoutingOptions | None = None,
        positions: Tensor | None = None,  # [T]; given = static-shape path (CUDA graphs)
        row_invariant: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """Run a window; returns logits [T, vocab] (float32) and final-norm hidden [T, hidden].

        row_invariant (CPU, eager): each row's bits are its one-row step's, whatever the window.
        CPU kernels choose their code path by shape (MKL runs one row as a GEMV and several
        through register tiles; reductions vectorise by shape), so a window's rows differ from
        the same rows decoded one at a time; here the window runs as its rows' one-row steps,
        one after another (exact mode's guarantee, DESIGN §11; it costs the window's batching)."""
        if row_invariant and self.device.type == "cpu" and positions is None and token_ids.shape[0] > 1:
            rows = [self.forward(token_ids[i : i + 1], cache, routing=routing and routing.row(i))
                    for i in range(token_ids.shape[0])]
            return torch.cat([logits for logits, _ in rows]), torch.cat([hidden for _, hidden in rows])
        hidden = self._trunk(token_ids, cache, routing, positions)
        return self.lm_head(hidden).float(), hidden

    @torch.inference_mode()
    def prefill(self, token_ids: Tensor, cache: KVCache, *, routing: RoutingOptions | None = None) -> Tensor:
        """A prompt chunk into the cache: final-norm hidden [T, hidden] only (prompt rows need no
        logits, and a chunk's [T, vocab] float32 logits would be its largest tensor)."""
        return self._trunk(token_ids, cache, routing, None)

    def _trunk(self, token_ids: Tensor, cache: KVCache, routing: RoutingOptions | None,
               positions: Tensor | None) -> Tensor:
        positions, visible = self._window(cache, token_ids.shape[0], positions)
        x = self.embed_tokens(token_ids)
        for index, layer in enumerate(self.layers):
            keys, values = cache.layer(index)
            x = layer(x, positions, keys, values, self.rotary, visible, routing)
        return self.norm(x)

    @torch.inference_mode()
    def forward_mtp(
        self,
        hidden: Tensor,  # [T, hidden]: trunk final-norm rows (or the MTP's own output when chaining)
        next_token_ids: Tensor,  # [T]: the token after each hidden row's position
        cache: KVCache,
        *,
        routing: RoutingOptions | None = None,
        positions: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """MTP rows: logits [T, vocab] for the token after next, and the MTP output hidden [T, hidden].

        Row i sits at the position of hidden[i]; RoPE only sees relative positions.
        """
        mtp = self._require_mtp()
        positions, visible = self._window(cache, hidden.shape[0], positions)
        x = mtp.inputs(self.embed_tokens(next_token_ids), hidden)
        keys, values = cache.layer(0)
        x = mtp.layers[0](x, positions, keys, values, self.rotary, visible, routing)
        out = mtp.norm(x)
        return self.lm_head(out).float(), out

    # -- scoring API ------------------------------------------------------------------------

    def score(self, token_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Full-sequence scoring without a persistent cache: logits [n, vocab], hidden [n, hidden]."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.int64, device=self.device).reshape(-1)
        return self.forward(token_ids, self.new_cache(max(token_ids.shape[0], 1)))

    def score_mtp(self, hidden: Tensor, token_ids: Tensor) -> Tensor:
        """Teacher-forced MTP: row i uses hidden[i] and token_ids[i+1], predicts token i+2 → [n-1, vocab]."""
        self._require_mtp()
        token_ids = torch.as_tensor(token_ids, dtype=torch.int64, device=self.device).reshape(-1)
        if hidden.shape[0] != token_ids.shape[0]:
            raise ValueError(f"hidden has {hidden.shape[0]} rows for {token_ids.shape[0]} tokens")
        n = token_ids.shape[0] - 1
        if n < 1:
            return torch.empty((0, self.config.vocab_size), device=self.device)
        logits, _ = self.forward_mtp(hidden[:n], token_ids[1:], self.new_mtp_cache(n))
        return logits

