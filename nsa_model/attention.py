"""Attention modules: NSA (NSA_SPEC.md, "The module around the core") and its dense counterpart.

Both take x [B, T, dim] and return [B, T, dim], with the same constructor, so the decoder swaps them by config.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from nsa_model import ops
from nsa_model.cache import LayerCache
from nsa_model.config import ModelConfig, NSAConfig
from nsa_model.ops.decode import nsa_decode_step
from nsa_model.rope import RotaryEmbedding

BRANCHES = ("cmp", "slc", "win")  # order of the gates and of the per-branch K/V projections


def check_backend(backend: str) -> str:
    if backend != "auto" and backend not in ops.BACKENDS:
        raise ValueError(f"attention backend: unknown {backend!r}; choose one of {('auto',) + ops.BACKENDS}")
    return backend


def project_qkv(x: torch.Tensor, wq: nn.Linear, wk: nn.Linear, wv: nn.Linear, rope: RotaryEmbedding,
                cfg: ModelConfig, sets: int, backend: str, gate: nn.Linear | None = None,
                position: int | torch.Tensor = 0, weight: torch.Tensor | None = None,
                into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """[q, k_0 .. k_{sets-1}, v_0 .. v_{sets-1}] for x [B, T, dim]: q [B, T, H, Dk] and the key sets rotated by
    RoPE as positions position .. position + T - 1 (0 .. T - 1 except after a cached context), the value sets
    [B, T, G, Dv] as they are, each a tensor of its own (attention keeps them for its
    backward; a view would keep the whole projection output alive, +860 MiB reserved for NSA at 32k tokens per
    micro-batch, kernels-notes.md v16). With `gate`, its output gate(x) [B, T, gate.out_features] follows.

    Fused, one matmul of the three weights concatenated: one GEMM forward, and in the backward one GEMM for x's
    gradient instead of three and the pointwise sum of their outputs. The parameters stay separate Linears, so
    checkpoints do not depend on it. With fused_gate the gate's weight joins that matmul, with rows of zeros
    that bring the matmul's width to a multiple of 64: apart, its 3H = 36 outputs are off the tensor-core
    alignment and cuBLAS runs three sm80 kernels on it, 2.4 ms per step at 125M T = 2048; and a row of the
    output that is not 128 bytes long gets a padded stride from inductor, which the split op then copies away
    (1.7 ms per step; kernels-notes.md, v18). On the triton backend the rotation and the split are one op each
    way (rope_split: each part read and written once; v18). `weight`: that matmul's weight as fused_qkv_weight
    made it, where a caller keeps one (a decoding cache: the concatenation was a copy of the weights a step).
    `into` (a decoding step, position a tensor): the key sets then value sets are written into these buffers
    [B, L, G, D] at rows position .., and returned in their place (rotate_and_split)."""
    H, G, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dv
    kv_into = list(into) if into is not None else [None] * (2 * sets)
    parts = [(wq, [H], [Dk], [True], [None]), (wk, [G] * sets, [Dk] * sets, [True] * sets, kv_into[:sets]),
             (wv, [G] * sets, [Dv] * sets, [False] * sets, kv_into[sets:])]
    if not cfg.fused_qkv:
        outs = [t for w, heads, dims, rotate, buffers in parts
                for t in rotate_and_split(w(x), rope, heads, dims, rotate, backend, position, buffers)]
        return outs if gate is None else outs + [gate(x)]
    heads, dims, rotate, buffers = (sum((p[i] for p in parts), []) for i in (1, 2, 3, 4))
    fuse_gate = gate is not None and cfg.fused_gate
    weight = fused_qkv_weight(wq, wk, wv, cfg, gate) if weight is None else weight
    if fuse_gate:
        n, width = gate.out_features, weight.shape[0] - sum(h * d for h, d in zip(heads, dims))  # padded to 64
        heads, dims, rotate, buffers = heads + [1], dims + [width], rotate + [False], buffers + [None]
    outs = rotate_and_split(F.linear(x, weight), rope, heads, dims, rotate, backend, position, buffers)
    if fuse_gate:
        logits = outs[-1][:, :, 0, :n]
        return outs[:-1] + [logits + gate.bias.to(logits.dtype)]  # the dtype Linear gives under autocast
    return outs if gate is None else outs + [gate(x)]


def fused_qkv_weight(wq: nn.Linear, wk: nn.Linear, wv: nn.Linear, cfg: ModelConfig,
                     gate: nn.Linear | None = None) -> torch.Tensor:
    """project_qkv's fused weight: wq, wk, wv concatenated, then with cfg.fused_gate the gate's rows and rows of
    zeros up to a width that is a multiple of 64."""
    weights = [wq.weight, wk.weight, wv.weight]
    if gate is not None and cfg.fused_gate:
        n, base = gate.out_features, sum(w.shape[0] for w in weights)
        width = -(-(base + n) // 64) * 64 - base  # the gate's columns, n of them real
        weights += [gate.weight, gate.weight.new_zeros(width - n, gate.in_features)]
    return torch.cat(weights)


def projection_to_keep(wq: nn.Linear, wk: nn.Linear, wv: nn.Linear, cfg: ModelConfig,
                       gate: nn.Linear | None = None) -> dict[str, torch.Tensor]:
    """{"qkv": the fused weight} for a decoding cache to keep (LayerCache.keep_weights), in the dtype F.linear
    computes in here: autocast's where it is on and would cast it (then it is not cast again each call; autocast
    leaves float64 alone); {} without fused_qkv."""
    if not cfg.fused_qkv:
        return {}
    weight, device = fused_qkv_weight(wq, wk, wv, cfg, gate), wq.weight.device.type
    if torch.is_autocast_enabled(device) and weight.dtype != torch.float64:
        weight = weight.to(torch.get_autocast_dtype(device))
    return {"qkv": weight}


def rotate_and_split(y: torch.Tensor, rope: RotaryEmbedding, heads: list[int], head_dims: list[int],
                     rotate: list[bool], backend: str, position: int | torch.Tensor = 0,
                     into: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """y [B, T, width] split into parts [B, T, heads_i, head_dims_i] (columns in order), each its own tensor,
    part i rotated by RoPE (rows at positions position ..) where rotate_i. The triton backend runs it as one
    Triton op (nsa::rope_split); the others in PyTorch, where under torch.compile inductor builds the backward's
    concatenation of the parts' gradients from the RoPE backward of each half (kernels-notes.md, v18).

    into (a decoding step's, with position a tensor): part i goes into the buffer into[i] [B, L, heads_i,
    head_dims_i] at rows position .. instead, and that buffer is returned in its place (None: a tensor of its
    own). On the triton backend the same launch writes them (rope_split_at), with no copy kernel a set."""
    backend = ops.resolve_backend(backend, y)
    if into is not None and any(b is not None for b in into):
        if not isinstance(position, torch.Tensor):
            raise ValueError("rotate_and_split: `into` writes at a decoding step's position, a tensor; got "
                             f"{position!r}")
        if backend == "triton":
            return ops.backend_module("triton", y).rope_split_at(y, rope.cos, rope.sin, heads, head_dims, rotate,
                                                                 position.reshape(1), into)
        rows = position.reshape(1) + torch.arange(y.shape[1], device=y.device) if y.shape[1] > 1 else \
            position.reshape(1)
        parts = rotate_and_split(y, rope, heads, head_dims, rotate, backend, position)
        return [part if buffer is None else buffer.index_copy_(1, rows, part.to(buffer.dtype))
                for part, buffer in zip(parts, into, strict=True)]
    if backend == "triton":
        cos, sin = rope.tables(position, y.shape[1])
        return ops.backend_module("triton", y).rope_split(y, cos, sin, heads, head_dims, rotate)
    parts, start = [], 0
    for h, d, r in zip(heads, head_dims, rotate):
        part = y[:, :, start:start + h * d].unflatten(-1, (h, d))
        parts.append(rope(part, position) if r else part.contiguous())
        start += h * d
    return parts


def _keep_only(prefixes: tuple[str, ...], ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing policy: keep the outputs of the ops named by `prefixes`, recompute the rest."""
    name = op.name() if hasattr(op, "name") else str(op)
    return CheckpointPolicy.MUST_SAVE if name.startswith(prefixes) else CheckpointPolicy.PREFER_RECOMPUTE


def recompute_around(core_ops: tuple[str, ...], fn, *args):
    """fn(*args) keeping for the backward only its inputs and what the ops named core_ops return; everything else
    (the q/k/v projection and its RoPE above all) is computed again in the backward from the inputs.

    Attention modules use it for `recompute`: their projections are cheap to run again (one GEMM) and large to
    keep (q and every K/V set, [B, T, heads, D] each), while the attention core is the costly part and keeps its
    own results. Under torch.compile the policy becomes the partitioner's recompute tags."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False,
                      context_fn=partial(create_selective_checkpoint_contexts, partial(_keep_only, core_ops)))


class Compressor(nn.Module):
    """phi of paper Eq. 7: maps each block of l raw vectors (stride d) to one compressed vector.

    `avg` is the mean of the block. `mlp` adds a learned intra-block position embedding, flattens the block and
    applies Linear(l*D -> hidden), GELU, Linear(hidden -> D). Where `backend` runs Triton, `mlp` is our op
    (nsa::phi_mlp: one launch forward, three backward, in place of about fifteen; kernels-notes.md v29), unless the
    launch config says phi_kernel="torch"; NSAAttention runs its phi_k and phi_v as one such op where they pair
    (`pairs_with`: two sets in the same launches, v32).
    """

    def __init__(self, kind: str, head_dim: int, nsa: NSAConfig, hidden: int, backend: str = "auto") -> None:
        super().__init__()
        self.kind, self.block, self.stride, self.backend = kind, nsa.cmp_block, nsa.cmp_stride, backend
        if kind == "mlp":
            self.pos_emb = nn.Parameter(torch.zeros(nsa.cmp_block, head_dim))
            self.fc1 = nn.Linear(nsa.cmp_block * head_dim, hidden)
            self.fc2 = nn.Linear(hidden, head_dim)
        elif kind != "avg":
            raise ValueError(f"Compressor.kind: must be 'avg' or 'mlp', got {kind!r}")

    def forward(self, x: torch.Tensor, checkpointed: bool = True) -> torch.Tensor:
        """[B, T, G, D] -> [B, Tc, G, D] with Tc = floor((T - l)/d) + 1 (0 when T < l). checkpointed=False: the
        caller recomputes this call in its backward anyway (recompute_around), so no checkpoint of its own."""
        B, T, G, D = x.shape
        if T < self.block:  # static shape: no compressed token exists yet
            return x.new_zeros(B, 0, G, D)
        if self.kind == "avg":
            return self._blocks(x).mean(dim=-1)
        if self._fused(x):  # keeps x and fc1's output [B * Tc, G, hidden] for its backward, no unfolded blocks
            return ops.backend_module("triton", x).phi_mlp(x, *self._mlp_weights(), self.block, self.stride)
        if checkpointed and torch.is_grad_enabled():
            # Kept for the backward, fc1's input would be l*D values per compressed token (l/d = 2 copies of x).
            # Recomputed from x (kept anyway) it costs one small MLP: 273 MiB less peak memory on nsa-125m at 64k
            # tokens per step in default compile mode. The checkpoint starts at x, not at its unfold view: a saved
            # view whose windows overlap would make torch <= 2.12 run the whole compiled backward without CUDA
            # graphs ("complex memory overlap"; bench/results/kernels-notes.md, v13).
            return checkpoint(self._mlp, x, use_reentrant=False)
        return self._mlp(x)

    def _fused(self, x: torch.Tensor) -> bool:
        if ops.resolve_backend(self.backend, x) != "triton":
            return False
        return ops.backend_module("triton", x).launch_config().phi_kernel == "fused"

    def pairs_with(self, other: Compressor, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Whether this phi on x and `other` on y run as one op (nsa::phi_mlp with two sets, whose launches cost
        about what one set's do; kernels-notes.md v32): both mlp through our kernels, x and y of one shape, and
        at least one compressed token."""
        return (self.kind == other.kind == "mlp" and x.shape == y.shape and x.shape[1] >= self.block
                and (self.block, self.stride) == (other.block, other.stride) and self._fused(x) and other._fused(y))

    def pair(self, other: Compressor, x: torch.Tensor, y: torch.Tensor,
             stacked: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x), other(y)) in one op; only where self.pairs_with(other, x, y). `stacked`: pair_weights(other),
        where a caller keeps them (a decoding cache); made here otherwise."""
        stacked = self.pair_weights(other) if stacked is None else stacked
        return ops.backend_module("triton", x).phi_mlp_pair(x, y, stacked, self.block, self.stride)

    def pair_weights(self, other: Compressor) -> tuple[torch.Tensor, ...]:
        """(w1, b1, w2, b2) of self and other stacked, [2, ...] each: pair's weights (b1 with the position
        embedding folded in, _fc1_bias)."""
        return tuple(torch.stack([a, b]) for a, b in zip(self._mlp_weights(), other._mlp_weights(), strict=True))

    def _mlp_weights(self) -> tuple[torch.Tensor, ...]:
        return self.fc1.weight, self._fc1_bias(), self.fc2.weight, self.fc2.bias

    def _fc1_bias(self) -> torch.Tensor:
        # fc1(blocks + pos_emb) = fc1(blocks) + fc1.weight @ pos_emb: the position embedding is one constant vector
        # in fc1's output, so it goes into the bias. Its gradient is then fc1.weight^T times a [hidden] sum, not
        # a sum over every block's l x D values (3 ms per step at T=32768 on nsa-125m, kernels-notes.md v12).
        return torch.addmv(self.fc1.bias, self.fc1.weight, self.pos_emb.flatten())

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        return x.unfold(1, self.block, self.stride)  # [B, Tc, G, D, l]: a view of x, no copy

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self._blocks(x).transpose(-1, -2).flatten(-2)  # [B, Tc, G, l*D]
        return self.fc2(F.gelu(F.linear(blocks, self.fc1.weight, self._fc1_bias())))


class NSAAttention(nn.Module):
    """Native Sparse Attention: compressed, selected and sliding-window branches mixed by learned gates.

    After each forward, `stats` holds detached on-device statistics of that call (no host sync; read them
    when logging): gate means per branch (cmp, slc, win), the mean number of selected blocks per query, and
    the mean distance in blocks between a query's block and its selected blocks.

    recompute: the backward computes the projection, RoPE, the gates, phi and the compressed and window branch
    outputs again instead of keeping them; kept are x, the core's log-sum-exps, selections and its selected branch
    output (nsa-125m at 32k tokens: about 240 MiB less per layer; kernels-notes.md, v27).
    """

    STATS = ("gate_cmp", "gate_slc", "gate_win", "sel_blocks", "sel_distance")
    CORE_OPS = ("nsa::core",)  # what recompute keeps (on the naive and torch backends: nothing, all is recomputed)

    def __init__(self, cfg: ModelConfig, backend: str = "auto", recompute: bool = False) -> None:
        super().__init__()
        self.cfg, self.nsa, self.backend, self.recompute = cfg, cfg.nsa, check_backend(backend), recompute
        ops.preload(self.backend)
        H, G, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dv
        self.kv_sets = 1 if cfg.shared_kv else len(BRANCHES)
        self.wq = nn.Linear(cfg.dim, H * Dk, bias=False)
        self.wk = nn.Linear(cfg.dim, self.kv_sets * G * Dk, bias=False)
        self.wv = nn.Linear(cfg.dim, self.kv_sets * G * Dv, bias=False)
        self.wo = nn.Linear(H * Dv, cfg.dim, bias=False)
        self.gate = nn.Linear(cfg.dim, len(BRANCHES) * H)
        hidden = cfg.phi_hidden or 2 * Dk
        self.phi_k = Compressor(cfg.phi, Dk, cfg.nsa, hidden, self.backend)
        self.phi_v = Compressor(cfg.phi, Dv, cfg.nsa, hidden, self.backend)
        self.rope = RotaryEmbedding(Dk, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("stats", torch.zeros(len(self.STATS)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        H, Dv = self.cfg.n_heads, self.cfg.dv
        if self.recompute:
            o, gates, blocks = recompute_around(self.CORE_OPS, self._attend, x)
        else:
            o, gates, blocks = self._attend(x)
        self._record_stats(gates, blocks)
        return self.wo(o.reshape(B, T, H * Dv))

    def _attend(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(o [B, T, H, Dv], gates [B, T, H, 3], blocks) for x [B, T, dim]."""
        q, kv, gates = self._project(x)
        (k_cmp, k_slc, k_win), (v_cmp, v_slc, v_win) = self._branch_sets(kv)
        k_cmp, v_cmp = self._compress(k_cmp, v_cmp, own_checkpoint=not self.recompute)
        # On the triton backend the core is one custom op (nsa::core): torch.compile traces through it.
        o, blocks = ops.nsa_attention(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, self.nsa,
                                      backend=self.backend, return_blocks=True, recompute=self.recompute)
        return o, gates, blocks

    def _project(self, x: torch.Tensor, position: int | torch.Tensor = 0, weight: torch.Tensor | None = None,
                 into: list[torch.Tensor] | None = None):
        """(q [B, T, H, Dk], the raw key sets then value sets [B, T, G, D], gates [B, T, H, 3]) of x [B, T, dim]
        at positions position ..; RoPE on the raw keys first: compression and selection work on rotated keys.
        into: a decoding cache's raw buffers, which the sets are written into and returned as (project_qkv)."""
        B, T, _ = x.shape
        q, *kv, gate_logits = project_qkv(x, self.wq, self.wk, self.wv, self.rope, self.cfg, self.kv_sets,
                                          self.backend, gate=self.gate, position=position, weight=weight, into=into)
        return q, kv, torch.sigmoid(gate_logits).view(B, T, self.cfg.n_heads, len(BRANCHES))

    def _branch_sets(self, kv: list[torch.Tensor]):
        """((k_cmp, k_slc, k_win), (v_cmp, v_slc, v_win)) of the raw sets: one each, or one shared by all three."""
        keys, values = kv[:self.kv_sets], kv[self.kv_sets:]
        return (tuple(keys) if self.kv_sets > 1 else (keys[0],) * 3), \
            (tuple(values) if self.kv_sets > 1 else (values[0],) * 3)

    def _compress(self, k_cmp: torch.Tensor, v_cmp: torch.Tensor, own_checkpoint: bool, stacked=None):
        """phi of the raw compression keys and values: [B, T, G, D] -> [B, Tc(T), G, D] each; `stacked`: the pair's
        weights, where a decoding cache keeps them."""
        if self.phi_k.pairs_with(self.phi_v, k_cmp, v_cmp):
            return self.phi_k.pair(self.phi_v, k_cmp, v_cmp, stacked)
        return self.phi_k(k_cmp, own_checkpoint), self.phi_v(v_cmp, own_checkpoint)

    @torch.no_grad()
    def prefill(self, x: torch.Tensor, cache: LayerCache, capacity: int) -> torch.Tensor:
        """This layer on a prompt x [B, T, dim] (positions 0 .. T - 1), as forward(), keeping in `cache` what
        decoding steps read: the raw key and value sets and the compressed tokens, in buffers of `capacity`
        positions (nsa_model/cache.py)."""
        B, T, _ = x.shape
        # what every step would make from the parameters alone, made once here and used by the prompt too
        weights = projection_to_keep(self.wq, self.wk, self.wv, self.cfg, self.gate)
        q, kv, gates = self._project(x, weight=weights.get("qkv"))
        (k_cmp, k_slc, k_win), (v_cmp, v_slc, v_win) = self._branch_sets(kv)
        if self.phi_k.pairs_with(self.phi_v, k_cmp, v_cmp):
            weights["phi"] = self.phi_k.pair_weights(self.phi_v)
        compressed = list(self._compress(k_cmp, v_cmp, own_checkpoint=False, stacked=weights.get("phi")))
        cache.fill(kv, compressed, capacity, max(1, self.nsa.num_cmp_tokens(capacity)))  # a slot the kernels read
        cache.keep_weights(weights, x.device)
        o = ops.nsa_attention(q, k_slc, v_slc, k_win, v_win, *compressed, gates, self.nsa, backend=self.backend)
        return self.wo(o.reshape(B, T, self.cfg.n_heads * self.cfg.dv))

    @torch.no_grad()
    def decode(self, x: torch.Tensor, cache: LayerCache, position: torch.Tensor, compresses: bool) -> torch.Tensor:
        """This layer on one token x [B, 1, dim] at `position` (a 1-element tensor on the device) after what
        `cache` holds, written into it first: one NSA decoding step (ops/decode.py) over the buffers. `compresses`:
        whether a compressed token ends at this position (NSAConfig.ends_cmp_token, known on the host). Its shapes
        do not depend on the position, so a CUDA graph of each kind of step serves every step of that kind."""
        B = x.shape[0]
        kept = cache.kept_weights(x.device)
        q, kv, gates = self._project(x, position, kept.get("qkv"), into=cache.raw)  # the sets written at p
        (k_cmp, k_slc, k_win), (v_cmp, v_slc, v_win) = self._branch_sets(kv)
        if compresses:  # phi of the last l raw positions, into the new token's slot; the other d - 1 steps skip it
            span, slot = cache.for_step("newest compressed token", lambda: self._newest_compressed(position))
            tokens = self._compress(k_cmp.index_select(1, span), v_cmp.index_select(1, span), own_checkpoint=False,
                                    stacked=kept.get("phi"))
            k_cmp, v_cmp = cache.write_compressed(list(tokens), slot)
        else:
            k_cmp, v_cmp = cache.compressed
        o, _ = nsa_decode_step(q[:, 0], k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates[:, 0], position, self.nsa,
                               backend=self.backend)
        return self.wo(o.reshape(B, 1, self.cfg.n_heads * self.cfg.dv))

    def _newest_compressed(self, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(span [l], slot [1]) of the compressed token that ends at p (a step that compresses): its raw positions
        p - l + 1 .. p and its slot (p - l + 1) / d."""
        start = position + 1 - self.nsa.cmp_block
        return start + torch.arange(self.nsa.cmp_block, device=position.device), start // self.nsa.cmp_stride

    @torch.no_grad()
    def _record_stats(self, gates: torch.Tensor, blocks: torch.Tensor) -> None:
        sums = self._stat_sums(gates, blocks)  # gate cmp, slc, win; chosen slots; their distances in blocks
        B, T, H, _ = gates.shape
        gate_means = sums[:3] / max(B * T * H, 1)
        sel_count = sums[3:4] / max(blocks[..., 0].numel(), 1)
        sel_distance = sums[4:5] / sums[3:4].clamp(min=1)
        self.stats.copy_(torch.cat([gate_means, sel_count, sel_distance]))

    def _stat_sums(self, gates: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """[5] float32: the sums of the three gates over (b, t, h), the number of chosen slots and the sum of their
        distances t // l' - block. On the triton backend one kernel (nsa::attention_stat_sums); in PyTorch ops the
        same sums were about seven reductions a layer call under torch.compile, 0.5 ms of the T = 8192 training
        step (kernels-notes.md v41)."""
        if ops.resolve_backend(self.backend, gates) == "triton":
            return ops.backend_module("triton", gates).attention_stat_sums(blocks, gates, self.nsa.sel_block)
        valid = blocks >= 0
        query_block = torch.arange(blocks.shape[1], device=blocks.device)[None, :, None, None] // self.nsa.sel_block
        distance = torch.where(valid, query_block - blocks, torch.zeros_like(blocks))
        return torch.cat([gates.float().sum(dim=(0, 1, 2)), valid.sum()[None].float(),
                          distance.sum()[None].float()])


class DenseAttention(nn.Module):
    """Causal grouped-query attention through PyTorch SDPA, the baseline NSA is compared against.

    recompute: the backward computes the projection and RoPE again; kept are x and SDPA's own results."""

    CORE_OPS = ("aten::_scaled_dot_product",)  # every SDPA kernel op (flash, cuDNN, efficient, math, CPU)

    def __init__(self, cfg: ModelConfig, backend: str = "auto", recompute: bool = False) -> None:
        super().__init__()
        # SDPA picks its own attention kernel; the backend runs RoPE and the q/k/v split (project_qkv)
        self.cfg, self.backend, self.recompute = cfg, check_backend(backend), recompute
        ops.preload(self.backend)
        H, G, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dv
        self.wq = nn.Linear(cfg.dim, H * Dk, bias=False)
        self.wk = nn.Linear(cfg.dim, G * Dk, bias=False)
        self.wv = nn.Linear(cfg.dim, G * Dv, bias=False)
        self.wo = nn.Linear(H * Dv, cfg.dim, bias=False)
        self.rope = RotaryEmbedding(Dk, cfg.max_seq_len, cfg.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        o = recompute_around(self.CORE_OPS, self._attend, x) if self.recompute else self._attend(x)
        return self.wo(o.transpose(1, 2).reshape(B, T, self.cfg.n_heads * self.cfg.dv))

    def _attend(self, x: torch.Tensor) -> torch.Tensor:
        """o [B, H, T, Dv] for x [B, T, dim]."""
        H, G = self.cfg.n_heads, self.cfg.n_kv_heads
        q, k, v = (t.transpose(1, 2) for t in project_qkv(x, self.wq, self.wk, self.wv, self.rope, self.cfg, 1,
                                                           self.backend))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=G != H)

    @torch.no_grad()
    def prefill(self, x: torch.Tensor, cache: LayerCache, capacity: int) -> torch.Tensor:
        """This layer on a prompt x [B, T, dim], as forward(), keeping its keys and values in `cache`."""
        B, T, _ = x.shape
        H, G = self.cfg.n_heads, self.cfg.n_kv_heads
        weights = projection_to_keep(self.wq, self.wk, self.wv, self.cfg)  # made once, for the prompt and steps
        q, k, v = project_qkv(x, self.wq, self.wk, self.wv, self.rope, self.cfg, 1, self.backend,
                              weight=weights.get("qkv"))
        cache.fill([k, v], [], capacity)
        cache.keep_weights(weights, x.device)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=G != H)
        return self.wo(o.transpose(1, 2).reshape(B, T, H * self.cfg.dv))

    @torch.no_grad()
    def decode(self, x: torch.Tensor, cache: LayerCache, position: torch.Tensor, compresses: bool) -> torch.Tensor:
        """One token x [B, 1, dim] at `position` over every cached key up to it (shapes independent of it);
        `compresses` is NSA's (False for a dense model, Transformer.step_compresses)."""
        B = x.shape[0]
        H, G = self.cfg.n_heads, self.cfg.n_kv_heads
        q, keys, values = project_qkv(x, self.wq, self.wk, self.wv, self.rope, self.cfg, 1, self.backend,
                                      position=position, weight=cache.kept_weights(x.device).get("qkv"),
                                      into=cache.raw)  # k and v written at p; the buffers returned
        visible = torch.arange(keys.shape[1], device=x.device) <= position
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                           attn_mask=visible[None, None, None, :], enable_gqa=G != H)
        return self.wo(o.transpose(1, 2).reshape(B, 1, H * self.cfg.dv))


def build_attention(cfg: ModelConfig, backend: str = "auto", recompute: bool = False) -> nn.Module:
    kind = NSAAttention if cfg.attention == "nsa" else DenseAttention
    return kind(cfg, backend, recompute)
