"""Checks shared by the fused-feature (EAGLE-3) drafter tests of every family: hooks that record
what enters a target's layers, and the check that the streams a target hands over are those.

Imported by the tests (never a test module itself)."""

from __future__ import annotations

import torch

from relaxspec.training.drafter.passes import teacher_forced


class LayerInputs:
    """Forward pre-hooks recording what enters each of ``layers``, and a hook on the last layer's
    output (index ``len(layers)``); ``seen[i]`` lists them call by call."""

    def __init__(self, layers):
        self.seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(layers) + 1)}
        last = len(layers)

        def output(_, __, out):
            self.seen[last].append(out[0] if isinstance(out, tuple) else out)

        self.handles = [layer.register_forward_pre_hook(lambda _, args, i=i: self.seen[i].append(args[0]))
                        for i, layer in enumerate(layers)]
        self.handles.append(layers[-1].register_forward_hook(output))

    def __enter__(self) -> "LayerInputs":
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def check_capture(target, layers, norm, cond: torch.Tensor, tokens: torch.Tensor,
                  cond_mask: torch.Tensor | None = None) -> None:
    """Through the decoding interface (a prefill, then a causal step: :func:`teacher_forced`),
    ``capture`` hands over the streams entering ``layers`` (the target's decoder layers; ``len``:
    the last one's output): at the prompt's last position they are what the hooks saw enter
    the layers in the prefill, and at every position the last layer's output through ``norm``
    (the final norm) is the final state handed over without capture; the logits never change."""
    count, width = len(layers), target.config.dim
    capture = (count, 0, count // 2)
    with LayerInputs(layers) as hooks:
        logits, hidden = teacher_forced(target, cond, tokens, cond_mask, capture=capture)
        prefill = torch.cat([hooks.seen[i][0][:, -1] for i in capture], -1)
    plain_logits, plain = teacher_forced(target, cond, tokens, cond_mask)
    assert hidden.shape == (*plain.shape[:2], 3 * width)
    torch.testing.assert_close(hidden[:, 0], prefill.to(hidden.dtype), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(norm(hidden[..., :width]), plain, atol=1e-5, rtol=1e-5)
    assert torch.equal(logits, plain_logits)
