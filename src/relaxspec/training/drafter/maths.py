"""The distillation's pure maths: tensors in, tensors out (no model, no files).

The pairing, where an off-by-one would hide: the target's teacher-forced pass gives hidden row
``F_j`` and logits row ``z_j``, both *predicting* image token ``t_j``. Drafter input ``j`` is the
pair ``(F_j, t_j)``; its output at ``j`` must match ``F_{j+1}`` (SmoothL1) and its head the
target's ``softmax(z_{j+1})`` (soft cross-entropy), for ``j = 0 .. N-2``. That is exactly what
the drafter is asked while decoding: given the feature that predicted the last committed token
and that token, guess the next feature. :func:`drafter_inputs` and :func:`drafter_targets` are
that pairing.

**Distillation** (``law_loss`` ``"kl"``, ``"tv"`` or ``"kl+tv"``). Exact acceptance of a draft
token is ``1 - TV(p, q)`` between the laws decoding compares: the target's and the drafter's
logits each guided with the CFG scale (``[cond; null]`` rows), divided by the temperature and
filtered (top-k / top-p) exactly as :func:`relaxspec.sampling.process_logits` does while
decoding. The distillation losses compare those laws (forward KL against the drafter's guided
law renormalised on the support of the target's filtered one, so it stays finite and is 0 when
the laws agree; TV against the drafter's filtered law), instead of EAGLE's per-stream
cross-entropy to the raw law (``"ce"``): :func:`drafter_loss`.

**Depths.** While decoding, the drafter's ``d``-th draft after a committed token is made from its
own guesses of the ``d - 1`` features before it. Those depths run in parallel (a "training-time
test", :func:`relaxspec.training.drafter.passes.unrolled`): level ``d`` reads level ``d - 1``'s
output one position back, and an attention mask (:func:`unrolled_mask`) lets it see the target's
features only up to the committed token, then its own chain. The mean ``1 - TV(p, q)`` per depth
on the target's own samples estimates the probability that exact speculative decoding accepts the
``d``-th draft given it accepted the ones before (for sampling; greedy decoding accepts by
argmax); :func:`chain_mal` turns those rates into a chain's tokens per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from relaxspec.sampling import SamplingConfig, guide, process_logits


def drafter_inputs(features: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pair ``j`` = (feature that predicted ``t_j``, ``t_j``) for ``j = 0 .. N-2``.

    ``features [R, N, dim]``, ``tokens [R, N]`` -> ``features [R, N-1, dim]``, ``tokens [R, N-1]``,
    RoPE ``positions [R, N-1]`` (image-token index ``j``)."""
    rows, n = tokens.shape
    positions = torch.arange(n - 1, device=tokens.device).expand(rows, n - 1)
    return features[:, :-1], tokens[:, :-1], positions


def drafter_targets(features: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What pair ``j`` must predict: the feature that predicts ``t_{j+1}`` and the target's
    logits of ``t_{j+1}``.

    ``features [R, N, dim]``, ``logits [R, N, vocab]`` -> ``next_features [R, N-1, dim]``,
    ``next_logits [R, N-1, vocab]`` (raw: no guidance, temperature or filter)."""
    return features[:, 1:], logits[:, 1:]


def unrolled_mask(count: int, depths: int, device=None) -> torch.Tensor:
    """Who may attend whom when ``depths`` levels of ``count`` pairs run as one sequence (level
    ``d`` occupies positions ``(d - 1) * count .. d * count - 1``), as
    :func:`~relaxspec.training.drafter.passes.unrolled` lays them out: ``[depths * count, depths *
    count]`` bool, True = may attend.

    Level ``k``'s query at pair ``i`` is the ``k``-th draft after committed token
    ``j = i - k + 1``: it sees level 1 (the target's features) at pairs ``<= j``, and level ``m``
    (``2 <= m <= k``) only at pair ``j + m - 1``, the drafts of its own chain (itself included).
    Level 1 alone is the causal mask."""
    level = torch.arange(depths, device=device).repeat_interleave(count)
    pair = torch.arange(count, device=device).repeat(depths)
    q_level, q_pair, k_level, k_pair = level[:, None], pair[:, None], level[None, :], pair[None, :]
    committed = (k_level == 0) & (k_pair <= q_pair - q_level)
    chain = (k_level >= 1) & (k_level <= q_level) & (k_pair == q_pair - q_level + k_level)
    return committed | chain


def guided_log_law(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Log of the decoding law before its filters: ``[cond; null]`` rows guided, divided by the
    temperature, ``log_softmax`` (fp32)."""
    logits = logits.float()
    if sampling.use_cfg:
        logits = guide(logits, sampling.cfg_scale)
    return (logits / max(sampling.temperature, 1e-5)).log_softmax(dim=-1)


def chain_mal(accept: torch.Tensor) -> torch.Tensor:
    """Tokens per step of a chain of ``len(accept)`` drafts accepted at those per-depth rates:
    ``1 + sum_d prod_{i <= d} accept_i``."""
    return 1 + accept.cumprod(dim=0).sum()


def depth_weights(depths: int, decay: float = 1.0, device=None) -> torch.Tensor:
    """How the loss weighs draft depths ``1 .. depths``: ``decay ** (d - 1)``, normalised to sum to
    1 (``decay`` 1: the plain mean; EAGLE-3's 0.8 over 7 depths, which the official code sums
    unnormalised, differs from it by a constant factor, the learning rate's business)."""
    weights = decay ** torch.arange(depths, dtype=torch.float32, device=device)
    return weights / weights.sum()


def drafter_loss(pred_features: torch.Tensor, pred_logits: torch.Tensor, next_features: torch.Tensor | None,
                 next_logits: torch.Tensor, *, feature_weight: float = 1.0, ce_weight: float = 0.1,
                 law_loss: str = "ce", distill_weight: float = 1.0, sampling: SamplingConfig | None = None,
                 train_depths: int | None = None, law_rows: torch.Tensor | None = None,
                 counts: tuple[int, int] | None = None, depth_decay: float = 1.0) -> dict[str, torch.Tensor]:
    """The loss over draft depths, and what it measures per depth.

    ``pred_features [R, D, T, dim]`` / ``pred_logits [R, D, T, vocab]``
    (:func:`~relaxspec.training.drafter.passes.unrolled`), ``next_features [R, T, dim]`` /
    ``next_logits [R, T, vocab]`` (:func:`drafter_targets`). At depth ``d`` pairs ``i >= d - 1``
    count. Over the first ``train_depths`` depths (default all), weighted by
    :func:`depth_weights` (``depth_decay`` 1: equally):

    - ``feature_loss``: SmoothL1 to the target's next feature (EAGLE; ``next_features`` ``None``:
      none, a fused-feature drafter's outputs are not the target's features);
    - ``ce`` (``law_loss="ce"``, EAGLE's): cross-entropy of each row's raw law under the drafter's
      (its floor is the target's entropy, not 0);
    - ``kl`` / ``tv`` (distillation): forward KL from the decoding law ``p`` (guided, tempered,
      filtered: :func:`~relaxspec.sampling.process_logits` with ``sampling``) to the drafter's
      guided, tempered law renormalised on ``p``'s support, and TV between the two decoding laws;
      ``"kl+tv"`` adds them.

    The laws are those of ``law_rows`` (default all): the ``[cond; null]`` pairs under CFG, the
    condition's rows without (decoding runs no other stream).

    ``loss = feature_weight * feature_loss + ce_weight * ce`` (or ``+ distill_weight * law``).
    Measured on every depth: ``accept [D]``, the mean ``1 - TV(p, q)`` of the decoding laws;
    ``top1 [D]``, how often the drafter's most likely token is the target's; ``accuracy`` = depth
    1's ``top1``. ``chain_mal``: ``1 + sum_d prod_{i <= d} accept_i``.

    ``counts``: the rows and law rows of the whole batch when these are one process's share of it
    (:func:`~relaxspec.training.drafter.passes.batch_loss` on a rank): every mean is then this
    share's part of the batch's, so the shares' values sum to the batch's (``chain_mal`` is left
    to the sum)."""
    sampling = sampling or SamplingConfig()
    rows, depths, count = pred_logits.shape[:3]
    train_depths = depths if train_depths is None else train_depths
    device = pred_logits.device
    # [D, T]: depth d (0-based) has a chain from pair d on
    valid = torch.arange(count, device=device)[None, :] >= torch.arange(depths, device=device)[:, None]
    per_depth = valid.sum(dim=1).clamp_min(1).float()

    def mean_per_depth(values: torch.Tensor, over: int | None = None) -> torch.Tensor:  # [rows, D, T] -> [D]
        return (values * valid).sum(dim=(0, 2)) / (per_depth * (values.shape[0] if over is None else over))

    all_rows, all_law_rows = counts or (None, None)

    weights = depth_weights(train_depths, depth_decay, device)

    def over_depths(values: torch.Tensor) -> torch.Tensor:  # [D] -> the trained depths' weighted mean
        return (values[:train_depths] * weights).sum()

    result = {}
    if next_features is not None:
        feature = F.smooth_l1_loss(pred_features.float(), next_features[:, None].float().expand_as(pred_features),
                                   reduction="none").mean(dim=-1)
        result["feature_loss"] = over_depths(mean_per_depth(feature, all_rows))
    elif feature_weight:
        raise ValueError("a feature loss needs the target's next features")
    if law_loss == "ce":
        probs = next_logits.float().softmax(dim=-1)[:, None]
        ce = -(probs * pred_logits.float().log_softmax(dim=-1)).sum(dim=-1)
        result["ce"] = over_depths(mean_per_depth(ce, all_rows))
        law = ce_weight * result["ce"]
    if law_rows is not None:  # the rows decoding compares: paired [cond; null] under CFG, else cond
        pred_logits, next_logits = pred_logits[law_rows], next_logits[law_rows]
    p = process_logits(next_logits, sampling)[:, None]  # [B, 1, T, V]: the decoding laws
    with torch.set_grad_enabled(torch.is_grad_enabled() and "tv" in law_loss):  # else a measure only
        q = process_logits(pred_logits, sampling)  # [B, D, T, V]
        tv = 0.5 * (p - q).abs().sum(dim=-1)
    if law_loss != "ce":
        law = torch.zeros((), device=device)
        if "kl" in law_loss:
            log_q = guided_log_law(pred_logits, sampling)
            if sampling.top_k > 0 or sampling.top_p < 1.0:  # q renormalised on p's support: finite, 0 at q = p
                log_q = log_q - torch.logsumexp(log_q.masked_fill(p == 0, float("-inf")), dim=-1, keepdim=True)
            kl = (torch.xlogy(p, p) - p * log_q).sum(dim=-1)
            result["kl"] = over_depths(mean_per_depth(kl, all_law_rows))
            law = law + result["kl"]
        if "tv" in law_loss:
            result["tv"] = over_depths(mean_per_depth(tv, all_law_rows))
            law = law + result["tv"]
        law = distill_weight * law
    result["loss"] = law if next_features is None else feature_weight * result["feature_loss"] + law
    with torch.no_grad():
        accept = mean_per_depth(1 - tv, all_law_rows)
        top1 = mean_per_depth((q.argmax(dim=-1) == p.argmax(dim=-1)).float(), all_law_rows)
    result.update(accept=accept, top1=top1, accuracy=top1[0])
    if counts is None:
        result["chain_mal"] = chain_mal(accept)
    return result
