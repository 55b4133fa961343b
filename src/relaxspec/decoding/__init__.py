"""Decoding: a :class:`DecodePlan` (draft source, acceptance rule, schedule, flags) run by one
driver (:mod:`relaxspec.decoding.driver`) over the schedules of :mod:`relaxspec.decoding.plan`'s
registry: ``raster`` (:mod:`~relaxspec.decoding.raster`), ``rows`` (:mod:`~relaxspec.decoding.rows`)
and ``ar`` (:mod:`~relaxspec.decoding.ar`). Methods (:mod:`relaxspec.methods`) build plans; this
package knows none of them."""

from relaxspec.caching import decode_lock
from relaxspec.decoding.ar import AR
from relaxspec.decoding.driver import drive
from relaxspec.decoding.plan import DecodePlan, Schedule, register, schedule
from relaxspec.decoding.raster import Raster
from relaxspec.decoding.result import DecodeResult, certified_tv
from relaxspec.decoding.rows import Rows
from relaxspec.decoding.target import target_slots
from relaxspec.errors import RelaxspecError

__all__ = ["AR", "DecodePlan", "DecodeResult", "Raster", "Rows", "Schedule", "certified_tv", "decode", "drive",
           "register", "reserve", "schedule"]


def decode(model, cond, sampling, options=None, *, generator=None, drafter=None, vq=None, cond_mask=None,
           progress: bool = False, on_step=None, source=None, rule=None) -> DecodeResult:
    """Generate ``[B, N]`` image tokens for ``cond`` as ``options`` say: a :class:`DecodePlan`, or
    a method's settings (:class:`relaxspec.methods.MethodOptions`: anything with ``plan(...)``,
    which builds the plan's parts), or ``None`` for plain AR.

    ``model``: the target, any :class:`~relaxspec.models.base.TargetModel` (LlamaGen's
    :class:`~relaxspec.models.llamagen.gpt.Transformer`); ``drafter``: an EAGLE drafter (methods
    sd / lantern / cool); ``vq``: the tokenizer whose codebook defines LANTERN's latent
    neighbours. ``options.compile`` runs every step as one compiled graph, ``options.profile``
    times the forwards apart from the engine, ``options.record_tv=False`` skips the TV record of
    relaxed rules. ``on_step(tokens, done)`` is called as tokens are committed
    (:func:`relaxspec.decoding.driver.drive`). ``source`` / ``rule``: a draft source and
    acceptance rule built once for many decodes (``relaxspec bench``), in place of what
    ``options`` would build. One decode at a time runs on a model: a second thread's waits."""
    with decode_lock(model):  # its decoding state is kept with the model
        if options is None:
            plan = DecodePlan(AR(), label="ar")
        elif isinstance(options, DecodePlan):
            given = [name for name, part in (("source", source), ("rule", rule), ("drafter", drafter), ("vq", vq))
                     if part is not None]
            if given:
                raise RelaxspecError(f"decode: a DecodePlan holds its parts; {', '.join(given)} given beside it would "
                                     "be ignored: put them in the plan")
            plan = options
        else:
            plan = options.plan(target=model, tokenizer=vq, drafter=drafter, sampling=sampling, source=source,
                                rule=rule)
        return drive(model, cond, sampling, plan, generator=generator, cond_mask=cond_mask, progress=progress,
                     on_step=on_step)


def reserve(model, options, source=None) -> None:
    """Size ``model``'s KV cache (and the drafter cache of ``source``, the draft source a decode
    of ``options`` uses; ``None`` for plain AR) for such a decode now, before any decode runs.
    ``options``: a :class:`DecodePlan` (its schedule and source), a :class:`Schedule`, or a
    method's settings (``options.schedule(model)`` gives it). Caches only grow (:func:`relaxspec.caching.grown`), so after reserving every method a run
    will decode (``relaxspec bench``'s, alternating image by image) each decode finds the caches at
    their final size: every compiled graph is made once, at one shape, and reads the same
    addresses from then on (issue 51)."""
    with decode_lock(model):  # not while another thread decodes on the model
        if isinstance(options, DecodePlan):
            options, source = options.schedule, options.source if source is None else source
        layout = (options if isinstance(options, Schedule) else options.schedule(model)).layout(model, source)
        if callable(getattr(layout.source, "reserve", None)):
            layout.source.reserve(model.config.block_size)
        target_slots(model, layout.scratch)
