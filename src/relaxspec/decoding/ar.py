"""Plain autoregressive sampling, token for token as upstream LlamaGen's ``generate``."""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from relaxspec.decoding.result import DecodeResult
from relaxspec.decoding.target import GuidedTarget
from relaxspec.models.gpt import Transformer
from relaxspec.sampling import SamplingConfig, sample_from


@torch.no_grad()
def generate_ar(model: Transformer, cond: torch.Tensor, sampling: SamplingConfig, *,
                generator: torch.Generator | None = None, cond_mask: torch.Tensor | None = None,
                progress: bool = False) -> DecodeResult:
    """Sample ``[B, N]`` image tokens one target forward at a time (the baseline, MAL 1.0)."""
    start = time.perf_counter()
    target = GuidedTarget(model, cond, sampling, cond_mask=cond_mask)
    batch, n, cls = target.batch, target.num_tokens, target.cls
    tokens = torch.empty(batch, n, dtype=torch.long, device=target.device)
    try:
        probs, _ = target.prefill()
        tokens[:, 0] = sample_from(probs, generator, sampling.greedy)
        for k in tqdm(range(1, n), desc="ar", disable=not progress, leave=False):
            where = torch.full((batch, 1), cls + k - 1, device=target.device)
            probs, _ = target.forward(tokens[:, k - 1 : k], where, where, kv_len=cls + k)
            tokens[:, k] = sample_from(probs[:, 0], generator, sampling.greedy)
    finally:
        target.close()
    forwards = torch.full((batch,), target.forwards)
    return DecodeResult(tokens=tokens.cpu(), target_forwards=forwards, drafter_forwards=torch.zeros(batch, dtype=torch.long),
                        step_tv=torch.zeros(batch, n), accept_lengths=[[1] * n for _ in range(batch)],
                        seconds=time.perf_counter() - start, target_forward_seconds=target.watch.seconds)
