"""Plain autoregressive sampling, token for token as upstream LlamaGen's ``generate``."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from relaxspec.caching import kept_buffer
from relaxspec.decoding.loop import step_runner
from relaxspec.decoding.result import DecodeResult
from relaxspec.decoding.target import GuidedTarget
from relaxspec.models.base import TargetModel
from relaxspec.noise import NoiseSlot, StepNoise
from relaxspec.sampling import SamplingConfig, sample_from


@dataclass(eq=False)
class ARLoop:
    """What one AR step reads and updates: the ``tokens [B, N]`` decoded so far and ``next``
    ``[1]``, the index of the token the step decides (both updated in place)."""

    target: GuidedTarget
    noise: StepNoise
    clock_slot: NoiseSlot | None
    tokens: torch.Tensor
    next: torch.Tensor


def ar_step(loop: ARLoop) -> None:
    """One target forward on the last token and the next token drawn (the exponential race on the
    step's clocks, or the argmax): one compiled graph with ``compile``."""
    batch, target = loop.tokens.shape[0], loop.target
    index = loop.next.expand(batch)[:, None]  # [B, 1]
    slots = target.cls + index - 1  # the last token's slot = its position
    probs, _ = target.forward(loop.tokens.gather(1, index - 1), slots, slots)
    clocks = None if loop.clock_slot is None else loop.noise.read(loop.clock_slot)
    token = sample_from(probs[:, 0], greedy=loop.clock_slot is None, clocks=clocks)
    loop.tokens.scatter_(1, index, token[:, None])
    loop.next.add_(1)


@torch.no_grad()
def generate_ar(model: TargetModel, cond: torch.Tensor, sampling: SamplingConfig, *,
                generator: torch.Generator | None = None, cond_mask: torch.Tensor | None = None,
                progress: bool = False, compile: bool = False, profile: bool = False, on_step=None) -> DecodeResult:
    """Sample ``[B, N]`` image tokens one target forward at a time (the baseline, MAL 1.0).

    No step reads anything back from the device (tokens are drawn by the exponential race, its
    clocks drawn before the step from ``generator``: the same numbers as drawing them in it);
    ``compile=True`` runs each step -- the forward, the draw, the write -- as one compiled graph:
    the compiled AR baseline. ``profile`` times the forwards (each its own graph with
    ``compile``). ``on_step(tokens, done)``: called after every token with the buffer ``[B, N]``
    and the committed counts ``[B]`` (see :func:`relaxspec.decoding.engine.generate_speculative`)."""
    start = time.perf_counter()
    target = GuidedTarget(model, cond, sampling, cond_mask=cond_mask, compile=compile and profile, compile_prefill=compile,
                          timed=profile)
    batch, n, device = target.batch, target.num_tokens, target.device
    try:
        first, probs, _ = target.start(generator=generator)
        tokens = kept_buffer(model, "ar.tokens", (batch, n), torch.long, device)
        tokens[:, 0] = first
        noise = StepNoise(device, owner=model)
        clock_slot = None if sampling.greedy else noise.reserve(probs.shape)
        noise.allocate()
        loop = ARLoop(target, noise, clock_slot, tokens, kept_buffer(model, "ar.next", (1,), torch.long, device).fill_(1))
        step = step_runner(ar_step, loop, device, (model,), compile=compile, profile=profile)
        if on_step is not None:
            on_step(tokens, torch.ones(batch, dtype=torch.long))
        for k in tqdm(range(1, n), desc="ar", disable=not progress, leave=False):
            noise.draw(generator)
            step()
            if on_step is not None:
                on_step(tokens, torch.full((batch,), k + 1, dtype=torch.long))
        tokens = tokens.cpu().clone()
    finally:
        target.close()
    forwards = torch.full((batch,), n)
    return DecodeResult(tokens=tokens, target_forwards=forwards, drafter_forwards=torch.zeros(batch, dtype=torch.long),
                        step_tv=torch.zeros(batch, n), accept_lengths=[[1] * n for _ in range(batch)],
                        seconds=time.perf_counter() - start,
                        target_forward_seconds=target.watch.seconds if profile else None,
                        drafter_forward_seconds=0.0 if profile else None, drafter_seconds=0.0 if profile else None)
