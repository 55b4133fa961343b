"""The one decoding loop: a :class:`~relaxspec.decoding.plan.DecodePlan` in, a
:class:`~relaxspec.decoding.result.DecodeResult` out, whatever the schedule.

Prologue: the target's prefill and token 0, the step's random numbers, the draft source's start
(the schedule says what it is handed) and the schedule's state. Loop: :func:`run_steps` (per
step: the noise's draws, the step -- one compiled graph with ``compile`` --, one lagged read of
how far the decode got). Epilogue: the state read back in one copy, the schedule's part of the
result and the times every schedule reports alike. Profile mode wraps the source in a
:class:`~relaxspec.decoding.steps.TimedSource` and the target in its stopwatch: no step branches
on it.
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from relaxspec.caching import decode_lock
from relaxspec.compiling import compiled
from relaxspec.decoding.loop import run_steps, step_runner
from relaxspec.decoding.plan import DecodePlan, Layout
from relaxspec.decoding.result import DecodeResult, read_once, watched_seconds
from relaxspec.decoding.steps import Loop, StepParts, TimedSource, check_compilable
from relaxspec.decoding.target import GuidedTarget
from relaxspec.decoding.verify import walk_tree
from relaxspec.drafting.base import target_layers
from relaxspec.noise import StepNoise
from relaxspec.sampling import SamplingConfig
from relaxspec.timing import Profiling


@torch.no_grad()
def drive(model, cond: torch.Tensor, sampling: SamplingConfig, plan: DecodePlan, *,
          generator: torch.Generator | None = None, cond_mask: torch.Tensor | None = None, progress: bool = False,
          on_step=None) -> DecodeResult:
    """Decode ``[B, N]`` image tokens for ``cond`` as ``plan`` says.

    Every step makes the same sequence of ops on tensors of fixed shapes and reads one number
    back, how many tokens are done, without blocking the device (one step late on a GPU,
    :mod:`relaxspec.decoding.loop`); counters, accept lengths and rank statistics stay on the
    device until the decode ends. ``on_step(tokens, done)``, if given, is called after token 0
    and after every step with the token buffer ``[B, N]`` (on the device) and how far each image
    got (the schedule's: committed counts ``[B]``, or with rows in parallel a ``[B, N]`` mask of
    the committed tokens): views of the decode's own buffers, valid during the call (what
    ``relaxspec demo`` draws from; its time counts in ``seconds``). The decode holds ``model``'s
    lock (:func:`relaxspec.caching.decode_lock`): its state is kept with the model, so a second
    thread's decode on it waits."""
    started = time.perf_counter()
    layout = plan.schedule.layout(model, plan.source)  # the plan checked against the model before anything runs
    with decode_lock(model):
        return _drive(model, cond, sampling, plan, layout, generator, cond_mask, progress, on_step, started)


def _drive(model, cond, sampling, plan: DecodePlan, layout: Layout, generator, cond_mask, progress, on_step,
           started: float) -> DecodeResult:
    target = GuidedTarget(model, cond, sampling, cond_mask=cond_mask, scratch=layout.scratch,
                          compile=plan.compile and plan.profile, compile_prefill=plan.compile, timed=plan.profile,
                          capture=target_layers(layout.source))
    if plan.rule is not None:
        plan.rule.prepare(target.device, owner=model)  # its numbers kept with the model: one address across decodes
    bar = tqdm(total=target.batch * target.num_tokens, desc=plan.label, disable=not progress, leave=False)
    try:
        loop = _start(model, target, plan, layout, generator)
        bar.update(target.batch)
        _run(loop, model, plan, generator, bar, on_step)
    finally:
        bar.close()
        target.close()
        if layout.source is not None:
            layout.source.close()
    return _result(loop, plan, started)


def _start(model, target: GuidedTarget, plan: DecodePlan, layout: Layout, generator) -> Loop:
    """The prologue: token 0, the source's start, the step's random numbers and the state."""
    schedule, source = plan.schedule, layout.source
    first, probs, hidden = target.start(source.caption_rows if source is not None else "upstream", generator)
    noise = StepNoise(target.device, owner=model)
    seconds = 0.0
    if source is not None:
        def start(tokens, laws, hidden_last):
            source.start(tokens, laws, hidden_last, target.streams, target.num_tokens, generator, target.greedy,
                         condition_hidden=hidden, condition_tokens=target.condition_tokens, noise=noise,
                         compile=plan.compile, profiling=Profiling(plan.compile) if plan.profile else None)

        began = time.perf_counter()
        schedule.start_source(model, layout, first, probs, hidden, start)
        seconds = time.perf_counter() - began  # the draft source's time before the first step
        check_compilable(source, plan.compile)
    slots = schedule.reserve(noise, layout, target.batch, probs.shape[-1], target.greedy)
    noise.allocate()
    exact_rule = plan.rule is None or plan.rule.lossless
    # A source whose drafts are not the laws it declares (SJD-PAC's official siblings) leaves no
    # record a rule could make: its run's TV is not recorded, even under an exact rule.
    exact_drafts = getattr(source, "lossless", True)
    parts = StepParts(target, noise, TimedSource(source, seconds) if plan.profile and source is not None else source,
                      plan.rule, slots, compiled(walk_tree, target.device) if plan.compile and plan.profile else walk_tree,
                      target.greedy, plan.record_tv and not exact_rule, generator,
                      tv_recorded=exact_drafts and (plan.record_tv or exact_rule))
    return Loop(parts, schedule, schedule.state(model, layout, target, first), target.num_tokens)


def _run(loop: Loop, model, plan: DecodePlan, generator, bar, on_step) -> None:
    """The step loop, to the last token."""
    parts, state = loop.parts, loop.state
    modules = (model, *(parts.source.models if parts.source is not None else ()))
    step = step_runner(loop.schedule.step, loop, parts.target.device, modules, compile=plan.compile,
                       profile=plan.profile)
    tokens, done = loop.schedule.progress(state, loop.num_tokens)
    if on_step is not None:
        on_step(tokens, done)
    batch = tokens.shape[0]
    run_steps(step, parts.noise, generator, getattr(state, "done", None), batch * loop.num_tokens, start=batch,
              bar=bar, on_step=None if on_step is None else (lambda: on_step(tokens, done)),
              steps=loop.schedule.fixed_steps(loop.num_tokens))


def _result(loop: Loop, plan: DecodePlan, started: float) -> DecodeResult:
    """The epilogue: the state read once, the schedule's fields and the times."""
    host = read_once(*loop.schedule.read_out(loop))
    fields = loop.schedule.result(host, loop)
    source, watch = loop.parts.source, loop.parts.target.watch
    timed = plan.profile
    return DecodeResult(**fields, seconds=time.perf_counter() - started,
                        drafter_seconds=(source.seconds if source is not None else 0.0) if timed else None,
                        target_forward_seconds=watch.seconds if timed else None,
                        drafter_forward_seconds=(watched_seconds(source) if source is not None else 0.0) if timed else None)


__all__ = ["drive"]
