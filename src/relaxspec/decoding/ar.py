"""Plain autoregressive sampling, token for token as upstream LlamaGen's ``generate``."""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from relaxspec.decoding.result import DecodeResult
from relaxspec.decoding.target import GuidedTarget
from relaxspec.models.base import TargetModel
from relaxspec.sampling import SamplingConfig, sample_from


@torch.no_grad()
def generate_ar(model: TargetModel, cond: torch.Tensor, sampling: SamplingConfig, *,
                generator: torch.Generator | None = None, cond_mask: torch.Tensor | None = None,
                progress: bool = False, compile: bool = False, on_step=None) -> DecodeResult:
    """Sample ``[B, N]`` image tokens one target forward at a time (the baseline, MAL 1.0).

    No step reads anything back from the device (tokens are drawn by the exponential race);
    ``compile=True`` runs the single-token step compiled -- the compiled AR baseline.
    ``on_step(tokens, done)``: called after every token with the buffer ``[B, N]`` and the
    committed counts ``[B]`` (see :func:`relaxspec.decoding.engine.generate_speculative`)."""
    start = time.perf_counter()
    target = GuidedTarget(model, cond, sampling, cond_mask=cond_mask, compile=compile)
    batch, n, cls = target.batch, target.num_tokens, target.cls
    tokens = torch.empty(batch, n, dtype=torch.long, device=target.device)
    where = (cls + torch.arange(n, device=target.device)).expand(batch, -1)  # slot = position of token k
    try:
        probs, _ = target.prefill()
        tokens[:, 0] = sample_from(probs, generator, sampling.greedy)
        if on_step is not None:
            on_step(tokens, torch.ones(batch, dtype=torch.long))
        for k in tqdm(range(1, n), desc="ar", disable=not progress, leave=False):
            step = where[:, k - 1 : k]
            probs, _ = target.forward(tokens[:, k - 1 : k], step, step)
            tokens[:, k] = sample_from(probs[:, 0], generator, sampling.greedy)
            if on_step is not None:
                on_step(tokens, torch.full((batch,), k + 1, dtype=torch.long))
    finally:
        target.close()
    forwards = torch.full((batch,), target.forwards)
    return DecodeResult(tokens=tokens.cpu(), target_forwards=forwards, drafter_forwards=torch.zeros(batch, dtype=torch.long),
                        step_tv=torch.zeros(batch, n), accept_lengths=[[1] * n for _ in range(batch)],
                        seconds=time.perf_counter() - start, target_forward_seconds=target.watch.seconds)
