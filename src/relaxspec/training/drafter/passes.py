"""The forward passes distillation runs: the frozen target's teacher-forced features, the
drafter unrolled over draft depths on them, and one batch's loss (:func:`batch_loss`)."""

from __future__ import annotations

import torch

from relaxspec.drafting.eagle import EagleDrafter
from relaxspec.models.base import TargetModel, TeacherForcedTarget, condition_states, condition_tokens, prepare_condition
from relaxspec.training.drafter.config import DrafterTrainConfig
from relaxspec.training.drafter.maths import drafter_inputs, drafter_loss, drafter_targets, unrolled_mask
from relaxspec.decoding.target import attention_mask, target_outputs


@torch.no_grad()
def target_features(target: TargetModel, tokens: torch.Tensor, labels: torch.Tensor,
                    null_rows: int, cond_mask: torch.Tensor | None = None,
                    capture: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target's teacher-forced pass over ``tokens [B, N]``, under each sequence's
    condition and, for the first ``null_rows`` sequences, also under the null condition.

    Returns hidden states ``[R, N, dim]`` and logits ``[R, N, vocab]`` (``R = B + null_rows``; row
    ``k`` predicts token ``k``): condition rows first, then null rows. A target without
    ``forward_train``, or conditions with a mask, run through its decoding interface
    (:func:`teacher_forced`). ``capture``: the hidden states are the streams entering those target
    layers (a fused-feature drafter's, :func:`relaxspec.models.base.run_capturing`).
    """
    cond, tokens, mask = _with_null_rows(target, tokens, labels, null_rows, cond_mask)
    if isinstance(target, TeacherForcedTarget) and mask is None:  # forward_train reads no mask
        logits, hidden = target.forward_train(cond, tokens, return_hidden=True, **target_outputs(capture))
        return hidden, logits
    logits, hidden = teacher_forced(target, cond, tokens, mask, capture=capture)
    return hidden, logits


def target_features_with_condition(target: TargetModel, tokens: torch.Tensor, labels: torch.Tensor, null_rows: int,
                                   cond_mask: torch.Tensor | None = None, caption_rows: str = "upstream"):
    """:func:`target_features`, and what a drafter that reads the condition takes, as decoding
    hands them over: the hidden states at every condition position ``[R, C, dim]`` (padded caption
    positions as ``caption_rows`` says: the drafter's own) and, for a target conditioned on
    tokens, those tokens ``[R, C]`` (else ``None``). Returns ``(hidden, logits, condition,
    condition_tokens)``."""
    cond, tokens, mask = _with_null_rows(target, tokens, labels, null_rows, cond_mask)
    logits, hidden, condition = teacher_forced(target, cond, tokens, mask, with_condition=True,
                                               caption_rows=caption_rows)
    return hidden, logits, condition, condition_tokens(target, cond)


def _with_null_rows(target: TargetModel, tokens: torch.Tensor, labels: torch.Tensor, null_rows: int,
                    cond_mask: torch.Tensor | None):
    """The batch's conditions, tokens and mask with the first ``null_rows`` repeated under the null
    condition."""
    cond = torch.cat([labels, target.null_condition(labels[:null_rows])])
    mask = None if cond_mask is None else torch.cat([cond_mask, cond_mask[:null_rows]])
    return cond, torch.cat([tokens, tokens[:null_rows]]), mask


@torch.no_grad()
def teacher_forced(target: TargetModel, cond: torch.Tensor, tokens: torch.Tensor,
                   cond_mask: torch.Tensor | None = None, with_condition: bool = False, caption_rows: str = "upstream",
                   capture: tuple[int, ...] | None = None):
    """Logits ``[R, N, V]`` and hidden states ``[R, N, D]`` of whole images ``tokens [R, N]``
    through the decoding interface: a prefill, then one causal step over tokens ``0 .. N-2``; row
    ``k`` predicts token ``k``. These are the features decoding shows the drafter, exactly.
    ``with_condition``: also the prefill's hidden states at every condition position ``[R, C, D]``
    (what decoding hands a drafter that reads the condition; padded caption positions as
    ``caption_rows`` says, :func:`relaxspec.models.base.condition_states`). ``capture``: as
    :func:`target_features`."""
    rows, count = tokens.shape
    cls = target.config.condition_length
    length = cls + count
    target.setup_caches(rows, length)
    key_valid = None
    if cond_mask is not None:
        key_valid = torch.ones(rows, length, dtype=torch.bool, device=target.device)
        key_valid[:, :cls] = cond_mask.to(target.device)
    slots = torch.arange(cls, device=target.device).expand(rows, cls)
    mask = attention_mask(slots, None, key_valid, length)
    prepare_condition(target, cond.to(target.device), mask)
    first_logits, first_hidden = target.prefill(cond.to(target.device), slots, slots, mask, **target_outputs(capture))
    positions = torch.arange(cls, length - 1, device=target.device).expand(rows, count - 1)
    logits, hidden = target.step(tokens[:, :-1].to(target.device), positions, positions,
                                 attention_mask(positions, None, key_valid, length), **target_outputs(capture))
    logits, hidden = torch.cat([first_logits[:, -1:], logits], 1), torch.cat([first_hidden[:, -1:], hidden], 1)
    if not with_condition:
        return logits, hidden
    valid = None if key_valid is None else key_valid[:, :cls]
    return logits, hidden, condition_states(target, cond.to(target.device), valid, first_hidden, caption_rows)


def unrolled(drafter: EagleDrafter, features: torch.Tensor, tokens: torch.Tensor, depths: int, *,
             noise: torch.Tensor | None = None, condition: torch.Tensor | None = None,
             condition_tokens: torch.Tensor | None = None, forward=None,
             through_depths: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's guesses at draft depths ``1 .. depths`` for every pair, as decoding makes
    them: depth 1 from the target's features (``features [R, N, dim]`` of ``tokens [R, N]``,
    plus ``noise`` on them when given), depth ``d`` at pair ``i`` from its own depth-``d - 1``
    guess at pair ``i - 1`` and token ``t_i`` (:func:`~relaxspec.training.drafter.maths.unrolled_mask`).

    Returns ``features [R, depths, N-1, dim]`` and logits ``[R, depths, N-1, vocab]``; at depth
    ``d`` pairs ``i < d - 1`` have no chain (their values are meaningless). Levels below the last
    are computed without gradients (each pass recomputes the levels before it); the last pass,
    which produces every output, carries them. ``through_depths`` (EAGLE-3's): every pass carries
    them, so a depth's loss also reaches the guesses of the depths before it that it read. A
    fused-feature drafter's level 1 (the target's fused streams) is brought to its width first
    (:meth:`~relaxspec.drafting.eagle.EagleDrafter.lift`). One depth is the plain causal pass. ``condition
    [R, C, dim]``: the target's hidden states at the condition positions, and ``condition_tokens
    [R, C]`` the condition's tokens, for a drafter that reads them (official LANTERN's).
    ``forward``: what runs the drafter (default the drafter; in a multi-process run its
    DistributedDataParallel wrapper, which averages the gradients over the processes)."""
    forward = forward or drafter
    in_features, in_tokens, positions = drafter_inputs(features, tokens)
    reads = {name: value for name, value in (("condition", condition), ("condition_tokens", condition_tokens))
             if value is not None}
    rows, count = in_tokens.shape
    levels = [drafter.lift(in_features.float() if noise is None else in_features.float() + noise)]
    grad = torch.is_grad_enabled()
    out_features = out_logits = None
    for depth in range(1, depths + 1):
        if depth > 1:  # level d, pair i reads level d-1's guess at pair i-1 (pair 0 has no chain)
            previous = out_features[:, (depth - 2) * count : (depth - 1) * count].float()
            previous = previous if through_depths else previous.detach()
            levels.append(torch.cat([torch.zeros_like(previous[:, :1]), previous[:, :-1]], dim=1))
        mask = None if depth == 1 else unrolled_mask(count, depth, tokens.device).expand(rows, -1, -1)
        # One call of `forward` a step (DistributedDataParallel's, which reduces the gradients, takes
        # one a backward pass); the passes before the last run the drafter itself, their gradients
        # joining the last's in the same backward pass.
        run = forward if depth == depths else drafter
        with torch.set_grad_enabled(grad and (through_depths or depth == depths)):
            out_features, out_logits = run(torch.cat(levels, dim=1), in_tokens.repeat(1, depth),
                                           positions.repeat(1, depth), attn_mask=mask, **reads)
    return (out_features.reshape(rows, depths, count, -1), out_logits.reshape(rows, depths, count, -1))


def batch_loss(drafter: EagleDrafter, tokens: torch.Tensor, labels: torch.Tensor, config: DrafterTrainConfig, *,
               noise_generator: torch.Generator | None = None, cond_mask: torch.Tensor | None = None,
               depths: int | None = None, share: slice | None = None, batch: int | None = None,
               forward=None) -> dict[str, torch.Tensor]:
    """Target features for one batch, the drafter unrolled over ``depths`` draft depths (default
    ``config.train_depths``; the loss counts the first ``train_depths``) on the (noised) pairs,
    the loss and its per-depth measures (:func:`~relaxspec.training.drafter.maths.drafter_loss`).

    ``share``: these rows are rows ``share`` of a batch of ``batch`` (one process's part of a
    multi-process step). What is drawn or averaged over the batch is the whole batch's, restricted
    to these rows: its null rows (``null_fraction`` of the batch, first rows first), its feature
    noise and the normalisers of every mean, so the parts' values (``chain_mal`` aside) sum to
    those of the batch in one process. ``forward``: what runs the drafter (:func:`unrolled`)."""
    target = drafter.target
    device = target.device
    tokens, labels = tokens.to(device), labels.to(device)
    rows = tokens.shape[0]
    first, whole = (0, rows) if share is None else (share.start, batch)
    null_all = round(config.null_fraction * whole)
    null_rows = min(max(null_all - first, 0), rows)  # the batch's null rows are its first ones
    depths = max(depths or 1, config.train_depths)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16):
        mask = None if cond_mask is None else cond_mask.to(device)
        if drafter.config.condition_pairs:  # official LANTERN's layout reads the condition too
            features, logits, condition, condition_tokens = target_features_with_condition(
                target, tokens, labels, null_rows, mask, drafter.config.caption_rows)
        else:
            (features, logits), condition, condition_tokens = target_features(
                target, tokens, labels, null_rows, mask, drafter.config.fused_layers), None, None
        noise = None
        if noise_generator is not None and config.noise > 0:
            shape = (whole + null_all, *features.shape[1:-1], features.shape[-1])
            uniform = torch.rand((shape[0], shape[1] - 1, shape[2]), generator=noise_generator, device=device)
            if share is not None:  # [cond rows; null rows] of the batch -> these rows'
                uniform = uniform[torch.cat([torch.arange(first, first + rows),
                                             whole + torch.arange(first, first + null_rows)]).to(device)]
            noise = (2 * uniform - 1) * config.noise
        pred_features, pred_logits = unrolled(drafter, features, torch.cat([tokens, tokens[:null_rows]]), depths,
                                              noise=noise, condition=condition,
                                              condition_tokens=condition_tokens, forward=forward,
                                              through_depths=config.through_depths)
        next_features, next_logits = drafter_targets(features, logits)
        if drafter.config.fused:  # its outputs are not the target's (fused) features: no feature loss
            next_features = None
    law_rows, _ = _law_rows(rows, null_rows, config.sampling.use_cfg, device)
    counts = None if share is None else (whole + null_all, _law_rows(whole, null_all, config.sampling.use_cfg)[1])
    return drafter_loss(pred_features, pred_logits, next_features, next_logits, feature_weight=config.feature_weight,
                        ce_weight=config.ce_weight, law_loss=config.law_loss, distill_weight=config.distill_weight,
                        sampling=config.sampling, train_depths=config.train_depths, law_rows=law_rows, counts=counts,
                        depth_decay=config.depth_decay)


def _law_rows(batch: int, null_rows: int, use_cfg: bool, device=None) -> tuple[torch.Tensor | None, int]:
    """The rows of ``[cond batch; null null_rows]`` whose laws decoding compares (``None``: all)
    and how many: the paired ``[cond; null]`` rows under CFG, the condition's rows without
    (decoding runs no other stream)."""
    if use_cfg and null_rows < batch:
        return torch.cat([torch.arange(null_rows), torch.arange(batch, batch + null_rows)]).to(device), 2 * null_rows
    if not use_cfg and null_rows:
        return torch.arange(batch, device=device), batch
    return None, batch + null_rows
