"""The EAGLE draft source (arXiv 2401.15077): an :class:`~relaxspec.drafting.eagle.EagleDrafter` on
both CFG streams, its guesses laid out by a :class:`~relaxspec.drafting.base.DraftStructure`."""

from __future__ import annotations

import torch

from relaxspec.compiling import compiled
from relaxspec.drafting.base import DraftStructure, DraftTree
from relaxspec.drafting.eagle import EagleDrafter
from relaxspec.sampling import SamplingConfig, process_logits, stream_rows
from relaxspec.timing import Stopwatch


def drafter_step(drafter: EagleDrafter, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor, mask: torch.Tensor | None, sampling: SamplingConfig,
                 streams: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One drafter forward on every CFG stream: ``features [S*B, M, d]``, per-image ``tokens``,
    ``positions``, ``slots`` and ``mask [B, M, cache]`` (default causal by slot) -> predicted
    features ``[S*B, M, d]`` and processed draft laws ``q [B, M, V]``. What ``--compile``
    compiles for the drafter."""
    def rows(x):
        return stream_rows(x, streams)

    # Padding pairs and finished rows may point past the image; their outputs are never used.
    positions = positions.clamp(max=drafter.rope.shape[0] - 1)
    feats, logits = drafter(features, rows(tokens), rows(positions), cache_slots=rows(slots), attn_mask=rows(mask))
    return feats, process_logits(logits, sampling)


class EagleSource:
    """Drafts with an :class:`EagleDrafter` on both CFG streams, laid out by ``structure``.

    Drafter cache: pair ``j`` (feature that predicted token ``j``, token ``j``) lives in slot
    ``j``; a step's tree node ``i`` uses slot ``root_index + i`` (the root's own pair is slot
    ``root_index``, already committed), so draft slots are overwritten by the next catch-up.
    """

    def __init__(self, drafter: EagleDrafter, structure: DraftStructure, sampling: SamplingConfig,
                 compile: bool = False):
        self.drafter, self.structure, self.sampling = drafter, structure, sampling
        self.max_nodes = structure.max_nodes
        self.max_depth = structure.depth
        self.forwards = 0
        self.compile = compile

    # -- plumbing shared by the structures ----------------------------------------------
    def start(self, first_tokens, first_probs, first_hidden, streams: int, num_tokens: int, generator,
              greedy: bool, *, condition_hidden=None, condition_tokens=None) -> None:
        """Called once after the target's prefill: ``first_tokens [B]`` (image token 0), the law it
        was drawn from ``first_probs [B, V]``, the hidden state that predicted it ``first_hidden
        [S*B, 1, d]``, those of the whole condition ``condition_hidden [S*B, C, d]`` and, for a
        target conditioned on tokens, those tokens ``condition_tokens [S*B, C]`` (what a drafter
        that reads the condition caches first). Feeds pair 0 so the first proposal has its root
        law."""
        self.batch, self.streams = first_tokens.shape[0], streams
        # Row indices made once on the device: an index made on the host is a copy and a sync per step.
        self._image_rows = torch.arange(self.batch, device=first_tokens.device)
        self._stream_rows = torch.arange(self.batch * streams, device=first_tokens.device)
        self.drafter.setup_caches(self.batch * streams, num_tokens + self.structure.drafter_slots + 1,
                                  condition=condition_hidden, condition_tokens=condition_tokens)
        self.cache_length = self.drafter.cache_length
        device = first_tokens.device
        self._step = compiled(drafter_step, device) if self.compile else drafter_step
        self.forwards = 0
        self.watch = Stopwatch(first_tokens.device)  # time inside the drafter's forward calls
        zero = torch.zeros_like(first_tokens)
        self.catch_up(first_hidden, first_tokens[:, None], zero, torch.ones_like(zero))

    def close(self) -> None:
        """The drafter's cache stays allocated for the next decode of the same shape, as the
        target's does (``drafter.clear_caches()`` frees it)."""

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return stream_rows(x, self.streams)

    def expand(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter forward: ``features [S*B, M, d]`` (of the inputs' parents), ``tokens
        [B, M]`` ... -> predicted features ``[S*B, M, d]`` and processed draft laws ``q [B, M, V]``.
        ``mask [B, M, cache_length]`` (default: causal by slot over the whole cache)."""
        with self.watch:
            feats, q = self._step(self.drafter, features, tokens, positions, slots, mask, self.sampling, self.streams)
        self.forwards += 1
        return feats, q

    def catch_up(self, features: torch.Tensor, tokens: torch.Tensor, first: torch.Tensor, count: torch.Tensor) -> None:
        """Feed the newly committed pairs: ``features [S*B, M, d]`` (target states that predicted
        ``tokens [B, M]``), pair ``m`` of row b at slot ``first[b] + m``, ``count [B]`` real pairs.
        Leaves the root's predicted feature and draft law for the next :meth:`propose`."""
        width = tokens.shape[1]
        slots = first[:, None] + torch.arange(width, device=first.device)
        feats, q = self.expand(features, tokens, slots, slots, None)
        last = (count - 1).clamp(min=0)
        self.root_q = q[self._image_rows, last]
        self.root_feature = feats[self._stream_rows, self.rows(last)]

    def propose(self, roots: torch.Tensor, root_index: torch.Tensor, generator, greedy: bool) -> DraftTree:
        return self.structure.draft(self, roots, root_index, generator, greedy)

    def update(self, committed: torch.Tensor, path: torch.Tensor, count: torch.Tensor, root_index: torch.Tensor,
               target_probs: torch.Tensor, target_hidden: torch.Tensor, generator=None) -> None:
        """After verification: pairs for tokens ``root_index + 1 ..`` are (target state at the
        path node before, committed token)."""
        nodes = path.clamp(min=0)[:, : committed.shape[1]]
        feats = target_hidden.gather(1, self.rows(nodes)[:, :, None].expand(-1, -1, target_hidden.shape[-1]))
        self.catch_up(feats, committed.clamp(min=0), root_index + 1, count)
