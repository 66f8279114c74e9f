"""Text continuation from a trained Transformer: what a checkpoint writes, for a person to read.

The context is the last max_seq_len tokens. With use_cache (the default), the prompt runs through the model once
and each new token after it is one decoding step over the layers' caches (Transformer.forward_cached: for NSA the
raw keys and values, the compressed tokens, and a step that reads Tc + n*l' + w keys a head; on a GPU each step
is a CUDA graph replayed, one for each kind of step, DecodingSteps). Once the context is full, each step drops
its oldest token, which moves every position: the step then runs the model over the cropped context again, as
without the cache.
use_cache=False runs the whole context every step (the reference the cached path is tested against).
"""

from __future__ import annotations

import contextlib
import math

import torch

from nsa_model.model import Transformer


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    """Refuse settings that cannot sample, before a model is loaded."""
    if type(max_new_tokens) is not int or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: must be an int >= 0, got {max_new_tokens!r}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature: must be a finite number >= 0 (0: always the most likely token), "
                         f"got {temperature!r}")
    if top_k is not None and (type(top_k) is not int or top_k < 1):
        raise ValueError(f"top_k: must be an int >= 1 or None (every token), got {top_k!r}")


def next_tokens(logits: torch.Tensor, temperature: float, top_k: int | None,
                generator: torch.Generator | None) -> list[int]:
    """One id a row from a step's logits [rows, vocab]: the largest at temperature 0, else a draw from
    softmax(logits / T) over the top_k largest (and any tied with the k-th). One host sync for all the rows."""
    if temperature == 0:
        return logits.argmax(-1).tolist()  # ok-host-sync: the ids decide the stop and are the next step's input
    # shifted by the max first: a tiny temperature then sends the others to -inf instead of the max to +inf (NaN)
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    drawn = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
    return drawn[:, 0].tolist()  # ok-host-sync: one a step for all rows, outside any forward/backward (decoding)


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None,
               generator: torch.Generator | None) -> int:
    """next_tokens of one row of logits [vocab]."""
    return next_tokens(logits[None], temperature, top_k, generator)[0]


class DecodingSteps:
    """A model's decoding steps over one cache (Transformer.forward_cached after its prompt). On a GPU, the first
    step of each kind (Transformer.step_compresses: whether it ends a compressed token) runs eagerly (it compiles
    that kind's kernels) and is then captured as a CUDA graph that every later step of that kind replays: a step
    is a few hundred small kernels, whose launches from Python cost more than their work (v67: about 50 ms a token
    at nsa-125m on an H200, eagerly). A graph reads the token and position tensors that each call sets, and
    writes the cache's buffers in place."""

    def __init__(self, model: Transformer) -> None:
        self.model, self.cache = model, model.new_cache()
        self.graphs: dict[bool, torch.cuda.CUDAGraph] = {}  # by step_compresses
        self.logits: dict[bool, torch.Tensor] = {}  # each graph's output
        self.token: torch.Tensor | None = None  # the graphs' input

    def prompt(self, tokens: torch.Tensor, rows: int) -> torch.Tensor:
        """Logits [rows, T, vocab] of a prompt tokens [B, T] into the empty cache, which then holds `rows` rows
        for the steps: B = rows, or B = 1 and that row copied to each of the rows after its one pass (samples of
        one prompt, ModelCache.repeat_rows)."""
        logits = self.model.forward_cached(tokens, self.cache)
        if tokens.shape[0] != rows:
            self.cache.repeat_rows(rows)
            logits = logits.expand(rows, -1, -1)
        return logits

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        """Logits [B, 1, vocab] of token [B, 1] (one token a row of the cache) at the next position."""
        if not token.is_cuda:
            return self.model.forward_cached(token, self.cache)
        self.cache.room_for(1)
        kind = self.model.step_compresses(self.cache.length)
        if kind not in self.graphs:  # its first step, on a side stream as CUDA graphs want their warm-up
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                logits = self.model.forward_cached(token, self.cache)
            torch.cuda.current_stream().wait_stream(side)
            self._capture(token, kind)
            return logits
        self.token.copy_(token)
        self.cache.position.fill_(self.cache.length)
        self.graphs[kind].replay()
        self.cache.length += 1
        return self.logits[kind].clone()  # the graph's output tensor is rewritten by its next replay

    def _capture(self, token: torch.Tensor, kind: bool) -> None:
        if self.token is None:
            self.token = token.clone()
        graph = torch.cuda.CUDAGraph()
        # autocast's cache of cast weights would hand the graph tensors that leave with the autocast context
        autocast = (torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
                    if torch.is_autocast_enabled("cuda") else contextlib.nullcontext())
        torch.cuda.synchronize()  # ok-host-sync: once a kind, before its capture
        with autocast, torch.cuda.graph(graph):  # recorded, not run: the cache is not written here
            self.logits[kind] = self.model.decode_step(self.token, self.cache, kind)
        self.graphs[kind] = graph  # only a whole capture is ever replayed


def generate(model: Transformer, prompt: list[int], max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, stop_id: int | None = None, vocab_size: int | None = None,
             generator: torch.Generator | None = None, use_cache: bool = True) -> list[int]:
    """The tokens that follow `prompt` (not repeated), at most max_new_tokens of them, ending early after stop_id:
    generate_samples with one sample."""
    return generate_samples(model, prompt, max_new_tokens, 1, temperature=temperature, top_k=top_k, stop_id=stop_id,
                            vocab_size=vocab_size, generator=generator, use_cache=use_cache)[0]


@torch.no_grad()
def generate_samples(model: Transformer, prompt: list[int], max_new_tokens: int, samples: int, *,
                     temperature: float = 1.0, top_k: int | None = None, stop_id: int | None = None,
                     vocab_size: int | None = None, generator: torch.Generator | None = None,
                     use_cache: bool = True) -> list[list[int]]:
    """`samples` continuations of `prompt` (not repeated), drawn together as the rows of one batch: each at most
    max_new_tokens tokens, ending early after stop_id (the other rows go on until every row has ended).

    Each step's tokens come from next_tokens. Only ids below vocab_size (default: the model's) come out: a model's
    vocabulary is often padded past its tokenizer's (nsa-125m: 50304 rows for GPT-2's 50257 tokens), and a padded
    row has no text. generator (on the model's device) makes the draws repeatable. use_cache: see the module's
    docstring; the same tokens either way, up to rounding. With the cache the prompt runs once, for all the rows
    (DecodingSteps.prompt), and each step decodes every row at once: on a GPU a step of a few rows costs about what
    a step of one does, which is bound by launches and latency, not by the work of its rows (bench/decode.py
    --samples)."""
    check_sampling(max_new_tokens, temperature, top_k)
    if type(samples) is not int or samples < 1:
        raise ValueError(f"samples: must be an int >= 1, got {samples!r}")
    rows = model.cfg.vocab_size
    if vocab_size is not None and not 0 < vocab_size <= rows:
        raise ValueError(f"vocab_size: must be in 1..{rows} (the model's vocabulary), got {vocab_size}")
    if not prompt:
        raise ValueError("prompt: needs at least one token (a document's start is the EOS token before it)")
    bad = [t for t in prompt if not 0 <= t < rows]
    if bad:
        raise ValueError(f"prompt: token ids {bad[:5]} are outside the model's vocabulary of {rows}")
    tokens = torch.tensor([prompt], dtype=torch.long, device=next(model.parameters()).device)
    context = model.cfg.max_seq_len
    new: list[list[int]] = [[] for _ in range(samples)]
    steps = None
    for _ in range(max_new_tokens):
        if not use_cache:
            logits, _ = model(tokens[:, -context:])
        elif steps is not None and steps.cache.length < context:
            logits = steps(tokens[:, -1:])  # one decoding step
        else:  # the first step, or a full context that has just moved by one token: run it whole
            steps = DecodingSteps(model)
            logits = steps.prompt(tokens[:, -context:], samples)  # one row until the first draw: the prompt
        ids = next_tokens(logits[:, -1, :vocab_size or rows].float().expand(samples, -1), temperature, top_k,
                          generator)
        for row, token in zip(new, ids, strict=True):
            if not (row and row[-1] == stop_id):
                row.append(token)
        if all(row[-1] == stop_id for row in new):
            break
        tokens = torch.cat([tokens.expand(samples, -1), tokens.new_tensor(ids)[:, None]], dim=1)
    return new
