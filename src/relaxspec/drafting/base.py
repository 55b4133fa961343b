"""The drafting seam: what the engine and the drafting structures know of a draft source.

A speculative step asks its :class:`DraftSource` for a :class:`DraftTree` (node 0 = the root, the
last committed token), verifies it with one target forward, and tells the source the outcome.
The engine knows nothing else about a source. Implementations: :class:`~relaxspec.drafting.
eagle_source.EagleSource` (an EAGLE drafter laid out by a :class:`DraftStructure`: the fixed
shapes of :mod:`~relaxspec.drafting.static_tree`, chains included, or EAGLE-2's
:mod:`~relaxspec.drafting.dynamic_tree`) and :class:`~relaxspec.drafting.jacobi.JacobiSource`
(no drafter: SJD / SCD). Tree tables (ancestors, children, masks) live in
:mod:`relaxspec.drafting.tree_tables`, shared with verification.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from relaxspec.acceptance.base import one_hot
from relaxspec.noise import NoiseSlot, StepNoise
from relaxspec.timing import Profiling


@dataclass
class DraftTree:
    """One step's drafts for a batch; all ``[B, T]`` unless noted.

    ``tokens`` (node 0 = root), ``parents`` (-1 for the root, parent < child), ``depth`` (root 0),
    ``proposals [B, T, V]`` the law each token was drawn from, ``valid`` (False = never test),
    ``ancestors [B, T, T]`` node i may attend to node j (self included; what the target's mask
    is built from, ``None`` for a tree only verified).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    proposals: torch.Tensor
    valid: torch.Tensor
    ancestors: torch.Tensor | None = None
    #: Static structure (optional; a source that knows it lets the walk run without host syncs):
    #: ``children [B or 1, T, C]`` each node's children in sibling order (-1 padded),
    #: ``level_widths[d]`` the most children of a node at depth ``d`` (one entry per level that
    #: holds drafts), ``point_mass`` whether every proposal is one-hot.
    children: torch.Tensor | None = None
    level_widths: tuple[int, ...] | None = None
    point_mass: bool | None = None
    #: Walk it as SJD-PAC's official code does (every node tested, the longest accepted path
    #: committed: :func:`relaxspec.decoding.verify.walk_tree`); not exact with siblings.
    longest_row: bool = False

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


@runtime_checkable
class DraftSource(Protocol):
    """A source of draft trees. Shapes: ``B`` images, ``S`` CFG streams (rows ``[S*B, ...]``),
    ``V`` the vocabulary, ``d`` the target's width, ``T`` nodes of a tree.

    A source whose state is one per image rather than one per row (a drafter's cache) may also
    have ``for_lanes(lanes, grid)``: the view of it that rows in parallel draft with
    (:func:`relaxspec.decoding.rows.generate_rows`).

    ``max_nodes`` (the most nodes a tree has, root included) and ``max_depth`` size the engine's
    buffers. Set by :meth:`start`: ``level_widths`` -- the most children of a node at each draft
    depth, the same for every tree this decode (what the verification walk's tests and random
    numbers are sized by; ``None`` for a source whose trees have no fixed shape, which then runs
    eagerly only) -- and ``forwards_per_step``, the source's model calls in one :meth:`propose`
    and :meth:`update` (what ``drafter_forwards`` counts). ``models``: the modules its steps run (a
    drafter; what a compiled step packs and keeps at fixed addresses). In profile mode a source
    times its model calls in a :class:`relaxspec.timing.Stopwatch` kept as ``watch`` (``None``
    otherwise). ``caption_rows``: how the hidden states at padded caption positions it reads as
    ``condition_hidden`` are computed (:data:`relaxspec.models.base.CAPTION_ROWS`; ``"upstream"``
    for a source that reads none). ``target_layers`` (optional; ``None`` when absent): the target
    layers whose streams it reads as hidden states instead of the final ones (a fused-feature
    drafter's, :func:`relaxspec.models.base.run_capturing`), what the engine asks every target
    forward for (:func:`target_layers`). ``lossless`` (optional; ``True`` when absent): ``False``
    for a source whose drafts are not drawn from the laws its trees declare, so that even an exact
    rule does not commit the model's law (the run's TV is then not recorded, as for a relaxed rule
    with its record off); ``longest_row`` (optional) for one whose trees are walked that way
    (:attr:`DraftTree.longest_row`; what the walk's random numbers are sized by).

    The decoding loop runs :meth:`propose` and :meth:`update` inside one step that it may compile
    as one graph (issue 41), so they must make the same ops on the same shapes every step, keep
    their state in tensors they update in place, read nothing back from the device and draw no
    random numbers themselves: what they draw is reserved in :meth:`start` on the step's
    :class:`~relaxspec.sampling.StepNoise` and read from it (drawn outside the step, before it).
    """

    max_nodes: int
    max_depth: int
    level_widths: tuple[int, ...] | None
    forwards_per_step: int
    models: tuple
    caption_rows: str

    def start(self, first_tokens: torch.Tensor, first_probs: torch.Tensor, first_hidden: torch.Tensor,
              streams: int, num_tokens: int, generator: torch.Generator | None, greedy: bool, *,
              condition_hidden: torch.Tensor | None = None, condition_tokens: torch.Tensor | None = None,
              noise: StepNoise | None = None, compile: bool = False, profiling: Profiling | None = None) -> None:
        """Once, after the target's prefill: image token 0 ``first_tokens [B]``, the law it was
        drawn from ``first_probs [B, V]``, the hidden state that predicted it ``first_hidden
        [S*B, 1, d]``, the hidden states at every condition position ``condition_hidden
        [S*B, C, d]`` and, for a target conditioned on tokens, the condition's tokens
        ``condition_tokens [S*B, C]`` (-1 where padded; else ``None``) -- what a drafter that reads
        the condition takes, as official LANTERN's do; ``num_tokens`` image tokens will be
        decoded. ``generator`` is for what ``start`` itself draws; every step's random numbers are
        reserved on ``noise`` (a sampled source given none cannot propose). ``compile``: the decode
        is compiled (a source that runs a model here runs it compiled too, so an image's set-up
        costs graph calls, not eager forwards). ``profiling``: profile mode (time the source's
        model calls)."""

    def propose(self, roots: torch.Tensor, root_index: torch.Tensor, greedy: bool) -> DraftTree:
        """The drafts after the last committed tokens ``roots [B]`` (image index ``root_index
        [B]``)."""

    def update(self, committed: torch.Tensor, path: torch.Tensor, count: torch.Tensor, root_index: torch.Tensor,
               target_probs: torch.Tensor, target_hidden: torch.Tensor) -> None:
        """After verification: ``committed [B, W]`` tokens (``count [B]`` of them real, 0 for a row
        that committed nothing this step) along tree nodes ``path [B, W]``; the target's laws
        ``target_probs [B, T, V]`` and hidden states ``target_hidden [S*B, T, d]`` at every node."""

    def close(self) -> None:
        """The decode is over (caches may be kept for the next one of the same shape)."""


@runtime_checkable
class FeatureDrafter(Protocol):
    """What a :class:`DraftStructure` needs from a feature-level drafter (EAGLE): the root's
    draft law ``root_q [B, V]`` and predicted feature ``root_feature [S*B, d]``, the drafter
    cache's length, the per-stream row expansion ``rows(x [B, ...]) -> [S*B, ...]`` and one
    forward ``expand(features [S*B, M, d], tokens [B, M], positions [B, M], slots [B, M],
    mask [B, M, cache_length] or None) -> (features [S*B, M, d], q [B, M, V])``; ``node_inputs``
    says where a tree's nodes sit in the drafter cache and what each may attend."""

    root_q: torch.Tensor
    root_feature: torch.Tensor
    cache_length: int

    def rows(self, x: torch.Tensor) -> torch.Tensor: ...

    def node_inputs(self, root_index: torch.Tensor, ancestors: torch.Tensor,
                    nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where tree nodes ``nodes [Q]`` of the trees rooted at ``root_index [B]`` (``ancestors
        [B, T, T]``) go in the drafter cache and what they see: ``slots [B, Q]`` and ``mask [B, Q,
        cache_length]``."""

    def expand(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class DraftStructure(Protocol):
    """How a feature drafter's guesses are laid out as a tree: at most ``max_nodes`` nodes,
    ``depth`` levels, ``drafter_slots`` drafter-cache slots per step, ``expansions`` drafter
    forwards per tree."""

    max_nodes: int
    depth: int
    drafter_slots: int
    expansions: int

    def level_widths(self, vocab: int) -> tuple[int, ...]:
        """The most children of a node at each draft depth (every tree of this structure)."""

    def prepare(self, device: torch.device) -> None:
        """Build what every tree on ``device`` reads (index tables), before the first step."""

    def reserve(self, noise: StepNoise, rows: int, vocab: int, greedy: bool) -> list[NoiseSlot]:
        """Reserve on ``noise`` the random numbers one draft of ``rows`` trees takes (sampled
        siblings' clocks, level by level); the slots :meth:`draft` reads, in order."""

    def draft(self, source: FeatureDrafter, roots: torch.Tensor, root_index: torch.Tensor, greedy: bool,
              clocks: list[torch.Tensor]) -> DraftTree:
        """One tree per row; ``clocks``: this step's numbers of the slots :meth:`reserve` gave."""


def target_layers(source) -> tuple[int, ...] | None:
    """The target layers whose streams ``source`` reads as hidden states (its ``target_layers``),
    ``None`` (the final states) for a source that says none, or none at all."""
    layers = getattr(source, "target_layers", None) if source is not None else None
    return None if layers is None else tuple(int(index) for index in layers)


class NoDrafts:
    """A source that drafts nothing: every tree is its root, so a step commits the bonus token
    alone (plain decoding in the engine's terms; ZipAR's rows in parallel)."""

    max_nodes, max_depth = 1, 0
    level_widths: tuple[int, ...] = ()
    forwards_per_step = 0
    models = ()
    watch = None
    caption_rows = "upstream"  # reads no condition

    def start(self, first_tokens, first_probs, first_hidden, streams, num_tokens, generator, greedy, *,
              condition_hidden=None, condition_tokens=None, noise=None, compile=False, profiling=None) -> None:
        rows, device = first_tokens.shape[0], first_tokens.device
        self.vocab = first_probs.shape[-1]

        def kept(name, value):  # one address across decodes of a shape, where the step has an owner
            return value if noise is None else noise.kept(f"nodrafts.{name}", value.shape, value.dtype).copy_(value)

        # every tree's fixed parts, made once a decode
        self._parents = kept("parents", torch.full((rows, 1), -1, dtype=torch.long, device=device))
        self._depth = kept("depth", torch.zeros(rows, 1, dtype=torch.long, device=device))
        self._valid = kept("valid", torch.ones(rows, 1, dtype=torch.bool, device=device))
        self._ancestors = kept("ancestors", torch.ones(rows, 1, 1, dtype=torch.bool, device=device))
        self._children = kept("children", torch.full((1, 1, 1), -1, dtype=torch.long, device=device))

    def propose(self, roots, root_index, greedy: bool) -> DraftTree:
        proposals = one_hot(roots, self.vocab, torch.float32)[:, None]
        return DraftTree(roots[:, None], self._parents, self._depth, proposals, self._valid, self._ancestors,
                         children=self._children, level_widths=(), point_mass=True)

    def update(self, committed, path, count, root_index, target_probs, target_hidden) -> None:
        pass

    def close(self) -> None:
        pass
