"""A Llama-style decoder (RMSNorm, SwiGLU, RoPE) whose attention is NSA or dense, by config.

    from nsa_model.model import Transformer
    model = Transformer(cfg)                  # cfg: nsa_model.config.ModelConfig
    logits, loss = model(tokens, targets)     # loss = mean cross-entropy over targets (the caller shifts);
                                              # with targets the logits come back detached
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nsa_model.attention import Compressor, NSAAttention, build_attention
from nsa_model.cache import LayerCache, ModelCache
from nsa_model.config import ModelConfig
from nsa_model.ops import resolve_backend


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down (an output projection: scaled init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str, attention_recompute: bool = False) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = build_attention(cfg, backend, recompute=attention_recompute)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.ffn = SwiGLU(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))

    def prefill(self, x: torch.Tensor, cache: LayerCache, capacity: int) -> torch.Tensor:
        x = x + self.attn.prefill(self.attn_norm(x), cache, capacity)
        return x + self.ffn(self.ffn_norm(x))

    def decode(self, x: torch.Tensor, cache: LayerCache, position: torch.Tensor, compresses: bool) -> torch.Tensor:
        x = x + self.attn.decode(self.attn_norm(x), cache, position, compresses)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, *, backend: str = "auto", activation_checkpointing: bool = False,
                 attention_recompute: bool = False) -> None:
        """activation_checkpointing: each block keeps only its input and runs again in the backward.
        attention_recompute: each attention module keeps only its input and its attention core's results, and
        recomputes its projections in the backward (attention.recompute_around); the lesser trade of the two."""
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"Transformer: cfg must be a ModelConfig, got {type(cfg).__name__}")
        if activation_checkpointing and attention_recompute:
            raise ValueError("Transformer: activation_checkpointing already recomputes the whole block; "
                             "attention_recompute inside it would only add work")
        self.cfg, self.activation_checkpointing = cfg, activation_checkpointing
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, backend, attention_recompute) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # Output projections feed the residual stream once per sub-layer: shrink them so the stream's
        # variance at init does not grow with depth (GPT-2 / Llama practice).
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        for block in self.blocks:
            nn.init.normal_(block.attn.wo.weight, std=out_std)
            nn.init.normal_(block.ffn.w2.weight, std=out_std)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.cfg.init_std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, Compressor) and module.kind == "mlp":
            nn.init.normal_(module.pos_emb, std=self.cfg.init_std)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        """tokens [B, T] int -> (logits [B, T, vocab], loss or None). targets [B, T], -100 entries ignored."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens: expected [B, T], got shape {tuple(tokens.shape)}")
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"tokens: sequence length {tokens.shape[1]} exceeds max_seq_len {self.cfg.max_seq_len}")
        if targets is not None and targets.shape != tokens.shape:
            raise ValueError(f"targets: expected shape {tuple(tokens.shape)}, got {tuple(targets.shape)}")
        x = self._run_blocks(self.tok_emb(tokens))
        return self._head(x, targets)

    def new_cache(self) -> ModelCache:
        """An empty decoding state for forward_cached, for max_seq_len positions on the model's device."""
        return ModelCache(len(self.blocks), self.cfg.max_seq_len, self.tok_emb.weight.device)

    @torch.no_grad()
    def forward_cached(self, tokens: torch.Tensor, cache: ModelCache) -> torch.Tensor:
        """Logits [B, T, vocab] of tokens [B, T] at the positions after what `cache` (new_cache()) holds, which
        it then holds too: first a prompt (the model's usual forward, keeping each layer's keys, values and
        compressed tokens), then one token a call, each a decoding step (decode_step) over the cache instead of a
        pass over the whole context. The same logits as forward() over the whole context, up to rounding."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens: expected [B, T], got shape {tuple(tokens.shape)}")
        cache.room_for(tokens.shape[1], tokens.shape[0])
        if cache.length == 0:
            cache.batch = tokens.shape[0]
            x = self.tok_emb(tokens)
            for block, layer in zip(self.blocks, cache.layers, strict=True):
                x = block.prefill(x, layer, cache.capacity)
            logits = self.lm_head(self.norm(x))
        else:
            cache.position.fill_(cache.length)
            logits = self.decode_step(tokens, cache, self.step_compresses(cache.length))
        cache.length += tokens.shape[1]
        return logits

    def step_compresses(self, position: int) -> bool:
        """Whether the decoding step at `position` ends a compressed token, for decode_step: NSA layers then run phi
        on their last l raw keys and values and store the new token (one step in d; a dense model's, never)."""
        return self.cfg.attention == "nsa" and self.cfg.nsa.ends_cmp_token(position)

    @torch.no_grad()
    def decode_step(self, token: torch.Tensor, cache: ModelCache, compresses: bool) -> torch.Tensor:
        """Logits [B, 1, vocab] of token [B, 1] at cache.position (a tensor the caller sets; forward_cached does),
        written into the cache; `compresses`: step_compresses of that position. Nothing else here depends on the
        position on the host: a CUDA graph of one call of each kind, replayed after the caller sets the token and
        position tensors, is every later step of that kind. The steps that end no compressed token (d - 1 in d)
        skip phi: a sixth of a step's GPU time at nsa-125m (kernels-notes.md v69)."""
        if cache.length == 0:
            raise ValueError("decode_step: the cache holds no prompt yet; run forward_cached on one first")
        cache.new_step()
        x = self.tok_emb(token)
        for block, layer in zip(self.blocks, cache.layers, strict=True):
            x = block.decode(x, layer, cache.position, compresses)
        return self.lm_head(self.norm(x))

    # The decoder stack and the head are separate methods for torch.compile. The whole model traces as one graph
    # (the Triton core is the custom op nsa::core); should a layer ever graph-break, a break inside the layer loop
    # would make dynamo run all of forward() eagerly, head included (lm_head, the fp32 logits and the
    # cross-entropy: the largest tensors of a step, +15 GB at 32k tokens per micro-batch when this happened).
    # With the loop in its own frame, the head stays compiled whatever the layers do.
    def _run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x

    def _head(self, x: torch.Tensor, targets: torch.Tensor | None):
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))
        # Training differentiates the loss only. Logits returned with their graph would be a second differentiable
        # output of the compiled forward: each backward would then take a zero gradient for them, [B, T, vocab]
        # (3.3 GB at 32k tokens with nsa-125m's vocabulary), filled, read by the cross-entropy backward and, under
        # CUDA graphs, copied into the graph's input buffer (model-step-h100-2026-11-23-v12e-graphs-*.json:
        # FillFunctor 2.0 ms and Memcpy DtoD 4.4 ms per step at T=2048).
        return logits.detach(), loss

    # --- accounting --------------------------------------------------------------------------------------------

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Distinct parameters (a tied embedding counts once); optionally without the token embedding."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_emb.weight.numel() if exclude_embeddings else n

    def attention_stats(self) -> dict[str, torch.Tensor]:
        """NSA gate and selection statistics of the last forward, averaged over layers, as 0-d device tensors.

        No host sync happens here; calling .item() on them (at logging time) is the only sync. Empty for dense.
        """
        layers = [b.attn.stats for b in self.blocks if isinstance(b.attn, NSAAttention)]
        if not layers:
            return {}
        mean = torch.stack(layers).mean(dim=0)
        return {f"nsa/{name}": mean[i] for i, name in enumerate(NSAAttention.STATS)}

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward) at seq_len: 6 * (matmul params) + attention.

        The attention term counts the keys each query really reads, averaged over the positions 0..T-1:
        dense reads t + 1 keys; NSA reads Nc(t) compressed tokens, its selected blocks' keys up to t and
        min(w, t + 1) window keys. Each key costs 2*Dk (score) + 2*Dv (value) FLOPs per head forward, times 3
        for forward + backward. phi's parameters run once per compressed token, not once per token.
        """
        cfg = self.cfg
        matmul_params = self.num_params() - (0 if cfg.tie_embeddings else self.tok_emb.weight.numel())
        keys = _mean_keys_per_query(cfg, seq_len)
        if cfg.attention == "nsa":
            phi_params = sum(p.numel() for b in self.blocks for p in (*b.attn.phi_k.parameters(),
                                                                        *b.attn.phi_v.parameters()))
            cmp_per_token = cfg.n_kv_heads * cfg.nsa.num_cmp_tokens(seq_len) / seq_len
            matmul_params += phi_params * (cmp_per_token - 1)
        attention = 3 * cfg.n_layers * cfg.n_heads * 2 * (cfg.head_dim + cfg.dv) * keys
        return 6 * matmul_params + attention


def _mean_keys_per_query(cfg: ModelConfig, seq_len: int) -> float:
    """Keys a query reads, averaged over positions 0 .. seq_len - 1 (a host-side count, done once)."""
    t = torch.arange(seq_len, dtype=torch.float64)
    if cfg.attention == "dense":
        return float((t + 1).mean())
    nsa = cfg.nsa
    cmp_keys = torch.where(t + 1 >= nsa.cmp_block, torch.div(t + 1 - nsa.cmp_block, nsa.cmp_stride,
                                                              rounding_mode="floor") + 1, 0)
    candidates = torch.div(t, nsa.sel_block, rounding_mode="floor") + 1
    # With more candidates than n, the current block (forced, cut at t) plus n - 1 full earlier blocks.
    sel_keys = torch.where(candidates <= nsa.n_selected, t + 1,
                           (nsa.n_selected - 1) * nsa.sel_block + t % nsa.sel_block + 1)
    win_keys = torch.clamp(t + 1, max=nsa.window)
    return float((cmp_keys + sel_keys + win_keys).mean())


# Dynamo's names of the NSA setting a Tune sweep varies, wherever a module keeps its NSAConfig as `.nsa` (re.match
# against each int it meets; no spaces or commas: torch splits its list on them).
SWEPT_SETTING_SOURCES = r".*\.nsa\.(sel_block|n_selected)$"


def compile_model(model: nn.Module, **compile_options) -> nn.Module:
    """torch.compile(model, **compile_options) with l' and n traced as symbolic ints, so the compiled graphs do not
    depend on them. By default dynamo bakes a module's ints into the graph as constants: each new (l', n) of a
    sweep was then a new graph for inductor, about 30 s of a GPU trial's first step that its compile caches, warm
    from the trial before, did not save (kernels-notes.md v73, v74). The NSA kernels still specialize on them, at
    launch.

    Only where every NSA attention module runs the Triton core, one opaque op (nsa::core) that takes l' and n as
    arguments. On the torch backend they shape the graph's own kernels, and symbolic they made a compiled CPU step
    1.9x slower (0.40 against 0.21 s, kernels-notes.md v74): there this is torch.compile.

    Adds SWEPT_SETTING_SOURCES to torch.compiler.config.dynamic_sources for this process (dynamo reads it when it
    traces, which is at the first call, not here), and pins Triton's cache folder (_pin_triton_cache_dir)."""
    sources = [s for s in torch.compiler.config.dynamic_sources.split(",") if s]
    if swept_settings_symbolic(model) and SWEPT_SETTING_SOURCES not in sources:
        torch.compiler.config.dynamic_sources = ",".join([*sources, SWEPT_SETTING_SOURCES])
    _pin_triton_cache_dir()
    return torch.compile(model, **compile_options)


def _pin_triton_cache_dir() -> None:
    """Sets TRITON_CACHE_DIR, where unset, to the folder Triton uses now (its default, ~/.triton/cache). Left unset,
    inductor sets it to a folder of its own (under its cache folder) when it sets up a Triton kernel of a compiled
    graph, and where the NSA kernels went then depended on the run: on one GPU node a sweep's second trial found
    none of the 20 its first trial had compiled and compiled all 21 of its own again (16 s;
    bench/results/kernels-notes.md v75). Pinned, every process on the node uses one folder."""
    import triton

    os.environ.setdefault("TRITON_CACHE_DIR", triton.knobs.cache.dir)


def swept_settings_symbolic(model: nn.Module) -> bool:
    """Whether compile_model traces l' and n of this model as symbolic ints: where model has NSA attention and each
    of its NSA attention modules runs the Triton core on the device of its parameters. The compiled graphs then
    serve every setting (pipeline/train/compile_cache.py leaves l' and n out of its key)."""
    modules = [m for m in model.modules() if isinstance(m, NSAAttention)]
    return bool(modules) and all(resolve_backend(m.backend, m.wq.weight) == "triton" for m in modules)
