"""Token sampling: greedy, temperature, top-k and top-p, with a seed per request.

``logits [R, V]`` float32, one row per sampling request.  Greedy rows
(temperature below 1e-5, where dividing by it would overflow) take the argmax; the others divide by the temperature, keep
the ``top_k`` largest logits (0: all), then the smallest set of tokens whose
probability mass reaches ``top_p`` (always at least one), and draw from the
renormalised distribution with the request's own generator, so a seeded
request samples the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import random

import torch

from unipage.scheduler import SamplingParams

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The request's generator (None for greedy): seeded from ``params.seed``, else at random."""
    if params.temperature < GREEDY_BELOW:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
    return gen


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits [V]`` with everything outside the top-k and the top-p nucleus set to -inf (no host sync)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above each one
        drop = before >= top_p
        drop[0] = False
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``logits [R, V]``, as an int64 tensor on their device; nothing waits for the
    device (the decode run-ahead feeds these tokens to the next step before the host has read them)."""
    tokens = logits.argmax(dim=-1)
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.temperature < GREEDY_BELOW:
            continue
        scaled = filter_logits(logits[row] / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(scaled, dim=-1)
        tokens[row] = torch.multinomial(probs, 1, generator=gen)[0]
    return tokens


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits [R, V]``."""
    return sample_tokens(logits, params, generators).tolist()
