"""Decoding: plain AR sampling, tree verification and the speculative engine."""

from relaxspec.caching import decode_lock
from relaxspec.methods import MethodOptions
from relaxspec.decoding.result import DecodeResult, certified_tv

__all__ = ["DecodeResult", "MethodOptions", "certified_tv", "decode", "reserve"]


def decode(model, cond, sampling, options: MethodOptions | None = None, *, generator=None, drafter=None,
           vq=None, cond_mask=None, progress: bool = False, on_step=None, source=None, rule=None) -> DecodeResult:
    """Generate ``[B, N]`` image tokens for ``cond`` with the method ``options`` names.

    ``model``: the target, any :class:`~relaxspec.models.base.TargetModel` (LlamaGen's
    :class:`~relaxspec.models.llamagen.gpt.Transformer`); ``drafter``: an EAGLE
    drafter (methods sd / lantern / cool); ``vq``: the tokenizer whose codebook defines LANTERN's
    latent neighbours. ``options.compile`` runs every step as one compiled graph,
    ``options.profile`` times the forwards apart from the engine, ``options.record_tv=False``
    skips the TV record of relaxed rules. ``on_step(tokens, done)`` is called as tokens are
    committed (:func:`relaxspec.decoding.engine.generate_speculative`; with rows in parallel
    ``done`` is a ``[B, N]`` mask of the committed tokens, as
    :func:`relaxspec.decoding.rows.generate_rows` says). ``source`` / ``rule``: a draft source
    and acceptance rule built once for many decodes (``relaxspec bench``), in place of what
    ``options`` would build.
    """
    with decode_lock(model):  # one decode at a time on a model: its decoding state is kept with it
        return _decode(model, cond, sampling, options or MethodOptions(), generator=generator, drafter=drafter,
                       vq=vq, cond_mask=cond_mask, progress=progress, on_step=on_step, source=source, rule=rule)


def _decode(model, cond, sampling, options: MethodOptions, *, generator, drafter, vq, cond_mask, progress, on_step,
            source, rule) -> DecodeResult:
    if options.method == "ar":
        from relaxspec.decoding.ar import generate_ar

        return generate_ar(model, cond, sampling, generator=generator, cond_mask=cond_mask, progress=progress,
                           compile=options.compile, profile=options.profile, on_step=on_step)
    if options.rows > 1:
        from relaxspec.decoding.engine import build_parts
        from relaxspec.decoding.rows import generate_rows
        from relaxspec.methods.grid import row_plan
        from relaxspec.methods import BuildContext

        if source is None or rule is None:
            built = build_parts(options, BuildContext(target=model, tokenizer=vq, drafter=drafter, sampling=sampling))
            source, rule = source or built[0], rule or built[1]
        return generate_rows(model, cond, sampling, source=source, rule=rule, plan=row_plan(options, model),
                             generator=generator, cond_mask=cond_mask, record_tv=options.record_tv,
                             compile=options.compile, profile=options.profile, progress=progress, on_step=on_step)
    from relaxspec.decoding.engine import generate_speculative

    return generate_speculative(model, cond, sampling, options, generator=generator, drafter=drafter, vq=vq,
                                cond_mask=cond_mask, progress=progress, on_step=on_step, source=source, rule=rule)


def reserve(model, options: MethodOptions, source=None) -> None:
    """Size ``model``'s KV cache (and the drafter cache of ``source``, the draft source a decode
    of ``options`` uses; ``None`` for plain AR) for such a decode now, before any decode runs.
    Caches only grow (:func:`relaxspec.caching.grown`), so after reserving every method a run will
    decode (``relaxspec bench``'s, alternating image by image) each decode finds the caches at
    their final size: every compiled graph is made once, at one shape, and reads the same
    addresses from then on (issue 51)."""
    from relaxspec.decoding.target import target_slots

    with decode_lock(model):  # not while another thread decodes on the model
        scratch = 0
        if options.method != "ar":
            if options.rows > 1:
                from relaxspec.decoding.rows import rows_layout
                from relaxspec.methods.grid import row_plan

                _, scratch, source = rows_layout(model, row_plan(options, model), source)
            else:
                scratch = source.max_nodes
            if callable(getattr(source, "reserve", None)):
                source.reserve(model.config.block_size)
        target_slots(model, scratch)
