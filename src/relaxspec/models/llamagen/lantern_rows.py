"""The caption rows of official LANTERN's converted LlamaGen target (``modeling_llamagen_kv``),
where they differ from upstream LlamaGen's: at padded caption positions (issue 43).

Upstream LlamaGen hides padded caption keys from every query and lets a padded position attend to
itself alone. LANTERN's converted target builds transformers' additive mask instead, and adds it
to the attention scores in fp32: the causal part in fp32 (``finfo(float32).min`` above the
diagonal) plus the padding part in the embeddings' dtype ``d`` (``finfo(d).min`` at every padded
key). Valid positions and image tokens see what they see upstream. A padded position ``i`` of a
left-padded caption has no valid key before it, so every entry of its row is swamped and what it
sees depends on the two minima:

- fp32: the padded keys up to ``i`` and every valid key after it sit at ``finfo(float32).min``
  (the padded keys after ``i`` twice that, -inf): it averages their values uniformly;
- bf16: the padded keys up to ``i`` sit at bf16's min, above fp32's: it averages those uniformly;
- fp16: fp16's min (-65504) does not swamp the scores: it attends by its scores over the padded
  keys up to ``i`` (LANTERN's fp32 sum rounds those scores to 1/256; this does not).

No later query reads a padded key, so these rows change nothing the target predicts. What they
change is what a drafter that reads the caption's hidden states sees: LANTERN's released drafters
attend to every caption row (:mod:`relaxspec.drafting.lantern_drafter`).
"""

from __future__ import annotations

import torch

from relaxspec.errors import RelaxspecError

#: An additive bias that swamps any attention score (in fp32 and bf16 alike) and leaves the
#: entries that carry it equal: softmax averages them uniformly.
SWAMPED = -1e30
#: The weights' dtypes LANTERN's rows are defined for.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def lantern_caption_bias(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[R, C, C]`` additive attention bias in ``dtype`` over a caption whose real tokens are
    ``valid [R, C]`` (bool): with it, scaled-dot-product attention gives every caption position
    what LANTERN's converted target gives it with its weights in ``dtype`` (module docstring)."""
    if dtype not in DTYPES:
        raise RelaxspecError(f"LANTERN's caption rows are defined for fp32, bf16 and fp16 weights, not {dtype}")
    count = valid.shape[1]
    keys = torch.arange(count, device=valid.device)
    before = keys[None, None, :] <= keys[None, :, None]  # [1, C, C]: key j at or before query i
    valid_keys = valid[:, None, :].bool()
    scored = before & valid_keys  # what a row with a valid key before it sees, by its scores
    has_scored = scored.any(-1, keepdim=True)
    padded_before = before & ~valid_keys
    if dtype == torch.float32:
        swamped = padded_before | (~before & valid_keys)
    elif dtype == torch.bfloat16:
        swamped = padded_before
    else:
        swamped = torch.zeros_like(padded_before)
        scored = scored | (padded_before & ~has_scored)  # fp16: by score over the padded keys before
    bias = torch.full(scored.shape, float("-inf"), device=valid.device)
    bias = bias.masked_fill(swamped & ~has_scored, SWAMPED).masked_fill(scored, 0.0)
    return bias.to(dtype)
