"""Plain autoregressive sampling, token for token as upstream LlamaGen's ``generate``: the ``ar``
schedule (one target forward a token, no drafts) and :func:`generate_ar`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relaxspec.decoding.driver import drive
from relaxspec.decoding.plan import DecodePlan, Layout, Schedule, State, register
from relaxspec.decoding.result import DecodeResult
from relaxspec.decoding.steps import Loop, WalkSlots, kept_state
from relaxspec.models.base import TargetModel
from relaxspec.sampling import SamplingConfig, sample_from


@dataclass(eq=False)
class ARState(State):
    """What an AR step updates: the ``tokens [B, N]`` decoded so far and ``n [B]``, the tokens
    committed (the index of the token the step decides)."""

    n: torch.Tensor


def ar_step(loop: Loop) -> None:
    """One target forward on the last token and the next token drawn (the exponential race on the
    step's clocks, or the argmax): one compiled graph with ``compile``."""
    parts, state = loop.parts, loop.state
    target, index = parts.target, state.n[:, None]  # [B, 1]
    slots = target.cls + index - 1  # the last token's slot = its position
    probs, _ = target.forward(state.tokens.gather(1, index - 1), slots, slots)
    clocks = None if parts.slots.clocks is None else parts.noise.read(parts.slots.clocks)
    token = sample_from(probs[:, 0], greedy=clocks is None, clocks=clocks)
    state.tokens.scatter_(1, index, token[:, None])
    state.n.add_(1)


@register
@dataclass(frozen=True)
class AR(Schedule):
    """One token a target forward, drawn by the exponential race on clocks drawn before the step
    (the same numbers as drawing them in it) or the argmax: the baseline, MAL 1.0."""

    name = "ar"
    drafts = False
    step = staticmethod(ar_step)

    def layout(self, model, source) -> Layout:
        return Layout(None, 0)

    def reserve(self, noise, layout: Layout, batch: int, vocab: int, greedy: bool) -> WalkSlots:
        return WalkSlots(clocks=None if greedy else noise.reserve((batch, vocab)))

    def state(self, model, layout: Layout, target, first: torch.Tensor) -> ARState:
        kept = kept_state(model, "ar", first.device)
        tokens = kept("tokens", (first.shape[0], target.num_tokens))
        tokens[:, 0] = first
        return ARState(tokens, kept("n", (first.shape[0],)).fill_(1))

    def fixed_steps(self, num_tokens: int) -> int:
        return num_tokens - 1

    def progress(self, state: ARState, num_tokens: int):
        return state.tokens, state.n

    def read_out(self, loop: Loop):
        return (loop.state.tokens,)

    def result(self, host, loop: Loop) -> dict:
        (tokens,) = host
        batch, n = tokens.shape
        return dict(tokens=tokens, target_forwards=torch.full((batch,), n),
                    drafter_forwards=torch.zeros(batch, dtype=torch.long), step_tv=torch.zeros(batch, n),
                    accept_lengths=[[1] * n for _ in range(batch)])


@torch.no_grad()
def generate_ar(model: TargetModel, cond: torch.Tensor, sampling: SamplingConfig, *,
                generator: torch.Generator | None = None, cond_mask: torch.Tensor | None = None,
                progress: bool = False, compile: bool = False, profile: bool = False, on_step=None) -> DecodeResult:
    """Sample ``[B, N]`` image tokens one target forward at a time (the baseline, MAL 1.0):
    :func:`relaxspec.decoding.driver.drive` with the ``ar`` schedule. ``compile=True`` runs each
    step -- the forward, the draw, the write -- as one compiled graph: the compiled AR baseline;
    ``profile`` times the forwards (each its own graph with ``compile``)."""
    return drive(model, cond, sampling, DecodePlan(AR(), compile=compile, profile=profile, label="ar"),
                 generator=generator, cond_mask=cond_mask, progress=progress, on_step=on_step)


__all__ = ["AR", "ARState", "ar_step", "generate_ar"]
