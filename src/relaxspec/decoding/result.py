"""What every decoding method returns."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DecodeResult:
    """Tokens and the measurements that come with them, per image.

    ``tokens [B, N]`` int64; ``target_forwards [B]`` target forwards each image needed (the
    condition prefill included, so plain AR gives ``N``); ``drafter_forwards [B]``;
    ``step_tv [B, N]`` the certified one-step TV distance recorded for each committed token
    (0 for lossless steps); ``accept_lengths`` per image, tokens committed by each target forward.
    ``seconds`` minus the two ``*_forward_seconds`` is the engine's own time (sampling, tree walk,
    cache moves, masks, Python): :attr:`overhead_seconds`.
    """

    tokens: torch.Tensor
    target_forwards: torch.Tensor
    drafter_forwards: torch.Tensor
    step_tv: torch.Tensor
    accept_lengths: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    drafter_seconds: float = 0.0  # in the draft source: drafter forwards + drafting bookkeeping
    target_forward_seconds: float = 0.0  # inside the target model's forward calls
    drafter_forward_seconds: float = 0.0  # inside the drafter model's forward calls
    rank_tests: torch.Tensor | None = None  # [depth, rank] sibling tests, summed over the batch
    rank_accepts: torch.Tensor | None = None  # [depth, rank] of those, accepted

    @property
    def overhead_seconds(self) -> float:
        return max(self.seconds - self.target_forward_seconds - self.drafter_forward_seconds, 0.0)

    def acceptance_rates(self) -> torch.Tensor | None:
        """Measured P(accept | depth, rank, elder siblings rejected) ``[depth, rank]`` (0 where
        never tested): the input of :func:`relaxspec.drafting.trees.build_tree`."""
        if self.rank_tests is None:
            return None
        return self.rank_accepts.double() / self.rank_tests.clamp(min=1).double()

    @property
    def mean_accepted_length(self) -> torch.Tensor:
        """MAL per image: tokens committed per target forward, bonus included (AR = 1.0)."""
        return self.tokens.shape[1] / self.target_forwards.float()

    @property
    def tv_bound(self) -> torch.Tensor:
        """Per image: the sum of one-step TV records (its expectation bounds the image-level TV)."""
        return self.step_tv.sum(dim=1)
