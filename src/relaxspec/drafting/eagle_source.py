"""The EAGLE draft source (arXiv 2401.15077): an :class:`~relaxspec.drafting.eagle.EagleDrafter` on
both CFG streams, its guesses laid out by a :class:`~relaxspec.drafting.base.DraftStructure`; and
:class:`LaneEagleSource`, the same drafter for rows in parallel (issue 31).

Rows in parallel: a chain, a fixed tree or EAGLE-2's dynamic tree for every open row of an image,
over one drafter cache per image.

:func:`relaxspec.decoding.rows.generate_rows` gives each open row a lane (``lanes`` of them per
image, lane ``l`` of image ``b`` being row ``b * lanes + l`` of every ``[B * lanes, ...]``
tensor). Each lane keeps its own root law and feature, but the lanes of an image draft from one
cache, laid out as the target's:

* pair ``j`` (the feature that predicted image token ``j``, token ``j``) sits in slot ``j``, its
  raster index, whichever lane committed it; a lane's draft nodes sit in the lane's own scratch
  slots past the image, so no lane overwrites another's pairs;
* a node sees the committed pairs up to its root's in raster order and its own ancestors (the
  target's row-causal mask, :func:`relaxspec.decoding.rows.row_causal_mask`, without what the
  target adds to it: the other rows' inputs of the same forward, a finished row's last token);
  a committed pair sees the committed pairs before it;
* a row's first step drafts nothing: its root is a stand-in (a token of a row above) and
  the lane's root law is stale (its previous row's, or a waiting lane's padding), so that step
  decides the bonus token alone and the pair it commits gives the lane the law of the row's next
  token.
"""

from __future__ import annotations

import torch

from relaxspec.caching import grown, kept_buffer, kept_copy
from relaxspec.compiling import compiled, fixed_addresses, tensors_of
from relaxspec.drafting.base import DraftStructure, DraftTree
from relaxspec.drafting.eagle import EagleDrafter
from relaxspec.drafting.tree_tables import tree_attention_mask
from relaxspec.errors import RelaxspecError
from relaxspec.noise import StepNoise
from relaxspec.sampling import DeviceSampling, SamplingConfig, process_logits, stream_rows
from relaxspec.timing import Profiling, Stopwatch


def drafter_step(drafter: EagleDrafter, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor, mask: torch.Tensor | None,
                 sampling: DeviceSampling) -> tuple[torch.Tensor, torch.Tensor]:
    """One drafter forward on every CFG stream: ``features [S*B, M, d]``, per-image ``tokens``,
    ``positions``, ``slots`` and ``mask [B, M, cache]`` (default causal by slot) -> predicted
    features ``[S*B, M, d]`` and processed draft laws ``q [B, M, V]``. What ``--compile``
    compiles for the drafter."""
    def rows(x):
        return stream_rows(x, sampling.streams)

    # Padding pairs and finished rows may point past the image; their outputs are never used.
    positions = positions.clamp(max=drafter.rope.shape[0] - 1)
    feats, logits = drafter(features, rows(tokens), rows(positions), cache_slots=rows(slots), attn_mask=rows(mask))
    return feats, process_logits(logits, sampling)


def first_pair(source: "EagleSource", hidden: torch.Tensor, tokens: torch.Tensor,
               counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair 0 of every row fed to the drafter (``hidden [S*B, 1, d]`` the target state that
    predicted image token 0, ``tokens [B]`` token 0, ``counts [B]`` rows that feed it): the root's
    draft law ``[B, V]`` and predicted feature ``[S*B, d]`` for the first proposal. What
    ``--compile`` compiles as a drafter's first graph of an image."""
    return source.catch_up(hidden, tokens[:, None], torch.zeros_like(tokens), counts, keep=False)


class EagleSource:
    """Drafts with an :class:`EagleDrafter` on both CFG streams, laid out by ``structure``.

    Drafter cache: pair ``j`` (feature that predicted token ``j``, token ``j``) lives in slot
    ``j``; a step's tree node ``i`` uses slot ``root_index + i`` (the root's own pair is slot
    ``root_index``, already committed), so draft slots are overwritten by the next catch-up.

    The state between steps -- the root's draft law ``root_q [B, V]`` and predicted feature
    ``root_feature [S*B, d]``, and the drafter's KV cache -- is kept in tensors allocated once per
    shape and updated in place, so a step compiled as one graph reads and writes them where they
    are (issue 41).
    """

    watch = None
    level_widths: tuple[int, ...] | None = None
    forwards_per_step = 0

    def __init__(self, drafter: EagleDrafter, structure: DraftStructure, sampling: SamplingConfig):
        self.drafter, self.structure, self.sampling = drafter, structure, sampling
        self.models = (drafter,)
        self.caption_rows = drafter.config.caption_rows
        # a fused-feature drafter reads these target layers' streams: what the engine asks every target forward for
        layers = drafter.config.fused_layers
        self.target_layers = None if layers is None else tuple(layers)
        self.max_nodes = structure.max_nodes
        self.max_depth = structure.depth

    # -- plumbing shared by the structures ----------------------------------------------
    def start(self, first_tokens, first_probs, first_hidden, streams: int, num_tokens: int, generator,
              greedy: bool, *, condition_hidden=None, condition_tokens=None, noise: StepNoise | None = None,
              compile: bool = False, profiling: Profiling | None = None) -> None:
        """Called once after the target's prefill: ``first_tokens [B]`` (image token 0), the law it
        was drawn from ``first_probs [B, V]``, the hidden state that predicted it ``first_hidden
        [S*B, 1, d]``, those of the whole condition ``condition_hidden [S*B, C, d]`` and, for a
        target conditioned on tokens, those tokens ``condition_tokens [S*B, C]`` (what a drafter
        that reads the condition caches first). Feeds pair 0 so the first proposal has its root
        law (with ``compile``, the drafter's forwards here run compiled, each shape one graph);
        reserves the structure's random numbers on ``noise``."""
        device = first_tokens.device
        width = self.drafter.config.dim * (1 if self.target_layers is None else len(self.target_layers))
        if first_hidden.shape[-1] != width:
            raise RelaxspecError(f"the drafter reads target features {width} wide (target layers "
                                 f"{self.target_layers or 'final'}); the target handed over {first_hidden.shape[-1]}: "
                                 "drive the target with the source's target_layers (GuidedTarget(capture=...))")
        self.batch, self.streams, self.num_tokens = first_tokens.shape[0], streams, num_tokens
        vocab = first_probs.shape[-1]
        # the sampling's numbers as device tensors kept with the drafter: a new cfg scale or
        # temperature reaches a compiled step as data (issue 51)
        self._sampling = self.sampling.on(
            device, lambda name, dtype: kept_buffer(self.drafter, f"sampling.{name}", (), dtype, device))
        # Row indices made once on the device: an index made on the host is a copy and a sync per step.
        # (kept at one address across decodes of a shape: a compiled step reads them)
        self._image_rows = self._keep("image_rows", torch.arange(self.batch, device=device))
        self._stream_rows = self._keep("stream_rows", torch.arange(self.batch * streams, device=device))
        cache_rows, length = self._cache_shape(num_tokens)
        length = self.reserve(num_tokens)
        self.drafter.setup_caches(cache_rows, length, condition=condition_hidden, condition_tokens=condition_tokens,
                                  compile=compile)
        self.cache_length = self.drafter.cache_length
        self.level_widths = self.structure.level_widths(vocab)
        self.structure.prepare(device)
        self.forwards_per_step = self.structure.expansions + 1  # the tree's levels and the catch-up
        self._noise = noise
        self._clock_slots = self.structure.reserve(noise, self.batch, vocab, greedy) if noise is not None else None
        self.watch = Stopwatch(device) if profiling is not None else None
        each = profiling is not None and profiling.compile  # profile mode: every forward its own graph
        self._step = compiled(drafter_step, device, self.drafter) if each else drafter_step
        counts = self._keep("first_counts", self._lay_out(length, device))
        first = first_pair
        if compile and not each:  # one graph an image, which reads everything where a step will
            first = compiled(first_pair, device, self.drafter)
            if device.type == "cuda":
                fixed_addresses(tensors_of(self, self.drafter) + [first_hidden, first_tokens])
        q, feats = first(self, first_hidden, first_tokens, counts)
        self.root_q = self._keep("root_q", q)
        self.root_feature = self._keep("root_feature", feats)

    def _keep(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` copied into this source's buffer ``name`` (one per drafter and shape, reused by
        every decode: a compiled step reads it, and updates it in place, at one address)."""
        return kept_copy(self.drafter, f"{type(self).__name__}.{name}", value)

    def reserve(self, num_tokens: int) -> int:
        """The drafter cache's slots for images of ``num_tokens`` tokens: the most any decode with
        this drafter has needed, this source's included (:func:`relaxspec.caching.grown`: a chain
        beside a tree, rows beside raster, run on one cache, so their compiled steps keep one
        address), sized now -- before a decode, :func:`relaxspec.decoding.reserve`."""
        return grown(self.drafter, "drafter.slots", self._cache_shape(num_tokens, rows=False))

    def _cache_shape(self, num_tokens: int, rows: bool = True):
        """The drafter cache's rows and slots (slots alone with ``rows=False``): one row per row
        and stream, pair ``j`` in slot ``j`` and a step's drafts after it."""
        slots = num_tokens + self.structure.drafter_slots + 1
        return (self.batch * self.streams, slots) if rows else slots

    def _lay_out(self, length: int, device: torch.device) -> torch.Tensor:
        """Whatever the cache's layout needs once the cache is set up (``length`` slots asked for),
        and how many of pair 0 each row then feeds, ``[B]``: here every row its own."""
        return torch.ones(self.batch, dtype=torch.long, device=device)

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
        if self.watch is None:
            return self._step(self.drafter, features, tokens, positions, slots, mask, self._sampling)
        with self.watch:
            return self._step(self.drafter, features, tokens, positions, slots, mask, self._sampling)

    def node_inputs(self, root_index: torch.Tensor, ancestors: torch.Tensor,
                    nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Node ``i`` of the tree rooted at ``root_index`` sits in slot ``root_index + i`` and sees
        every committed slot before the root and its own ancestors."""
        queries = nodes.expand(root_index.shape[0], -1)
        return root_index[:, None] + nodes, tree_attention_mask(root_index, ancestors, self.cache_length, queries)

    def for_lanes(self, lanes: int, grid: int) -> "EagleSource":
        """This source for rows in parallel (:func:`relaxspec.decoding.rows.generate_rows`): ``lanes``
        rows of each image drafting at once over one drafter cache
        (:class:`LaneEagleSource`)."""
        return LaneEagleSource(self.drafter, self.structure, self.sampling, lanes=lanes, grid=grid)

    def catch_up(self, features: torch.Tensor, tokens: torch.Tensor, first: torch.Tensor, count: torch.Tensor,
                 keep: bool = True):
        """Feed the newly committed pairs: ``features [S*B, M, d]`` (target states that predicted
        ``tokens [B, M]``), pair ``m`` of row b at slot ``first[b] + m``, ``count [B]`` real pairs.
        The root's draft law and predicted feature for the next :meth:`propose` go to
        ``root_q`` / ``root_feature`` (``keep``), or are returned."""
        width = tokens.shape[1]
        slots = first[:, None] + torch.arange(width, device=first.device)
        feats, q = self.expand(features, tokens, slots, slots, None)
        return self._root(feats, q, count, keep)

    def _root(self, feats: torch.Tensor, q: torch.Tensor, count: torch.Tensor, keep: bool):
        """The law and feature each row's last real pair predicts: into the buffers, or returned."""
        last = (count - 1).clamp(min=0)
        q, feats = q[self._image_rows, last], feats[self._stream_rows, self.rows(last)]
        if not keep:
            return q, feats
        self.root_q.copy_(q)
        self.root_feature.copy_(feats)
        return None

    def propose(self, roots: torch.Tensor, root_index: torch.Tensor, greedy: bool) -> DraftTree:
        if self._clock_slots is None:
            raise RuntimeError("this source was started without a StepNoise: it cannot draw its siblings")
        clocks = [self._noise.read(slot) for slot in self._clock_slots]
        return self.structure.draft(self, roots, root_index, greedy, clocks)

    def update(self, committed: torch.Tensor, path: torch.Tensor, count: torch.Tensor, root_index: torch.Tensor,
               target_probs: torch.Tensor, target_hidden: torch.Tensor) -> None:
        """After verification: pairs for tokens ``root_index + 1 ..`` are (target state at the
        path node before, committed token)."""
        nodes = path.clamp(min=0)[:, : committed.shape[1]]
        feats = target_hidden.gather(1, self.rows(nodes)[:, :, None].expand(-1, -1, target_hidden.shape[-1]))
        self.catch_up(feats, committed.clamp(min=0), root_index + 1, count)


class LaneEagleSource(EagleSource):
    """An :class:`EagleSource` whose rows are the open rows (lanes) of images painted in parallel
    (made by :meth:`EagleSource.for_lanes`); ``grid`` tokens a row. :meth:`start` takes
    ``first_tokens [B * lanes]`` and ``first_hidden [S * B * lanes, 1, d]`` per lane and the
    condition's states ``condition_hidden [S * B, C, d]`` per image."""

    def __init__(self, drafter, structure, sampling, *, lanes: int, grid: int):
        super().__init__(drafter, structure, sampling)
        self.lanes, self.grid = lanes, grid

    def _cache_shape(self, num_tokens: int, rows: bool = True):
        """One cache row per image and stream: the image's pairs, each lane's scratch slots, a
        spill slot."""
        slots = num_tokens + self.lanes * self.structure.drafter_slots + 1
        return (self.batch // self.lanes * self.streams, slots) if rows else slots

    def _lay_out(self, length: int, device: torch.device) -> torch.Tensor:
        """The lanes' slots and the committed-pair bitmap; pair 0 is lane 0's (row 0's): the other
        lanes start on a row's first step, which drafts nothing."""
        nodes = self.structure.drafter_slots
        self.spill = length - 1  # where the padding of a catch-up writes; never seen
        # a slot's raster index (scratch and spill slots: past every pair, so never "earlier")
        raster_of_slot = torch.full((self.cache_length,), self.num_tokens + 1, dtype=torch.long, device=device)
        raster_of_slot[: self.num_tokens] = torch.arange(self.num_tokens, device=device)
        self._raster_of_slot = self._keep("raster_of_slot", raster_of_slot)
        lane = torch.arange(self.batch, device=device) % self.lanes
        self._scratch = self._keep("scratch", self.num_tokens + lane[:, None] * nodes + torch.arange(nodes, device=device))
        self._not_root = self._keep("not_root", torch.arange(nodes, device=device) > 0)
        self.cached = kept_buffer(self.drafter, "LaneEagleSource.cached", (self.batch // self.lanes, self.cache_length),
                                  torch.bool, device).zero_()
        return (lane == 0).long()

    # -- lanes <-> images: [R * L, M, ...] <-> [R, L * M, ...] (stream-major rows stay so)
    def _images(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0] // self.lanes, self.lanes * x.shape[1], *x.shape[2:])

    def _lanes(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0] * self.lanes, x.shape[1] // self.lanes, *x.shape[2:])

    def expand(self, features, tokens, positions, slots, mask):
        """One drafter forward over every lane of every image at once (``mask`` is required)."""
        feats, q = super().expand(self._images(features), self._images(tokens), self._images(positions),
                                  self._images(slots), self._images(mask))
        return self._lanes(feats), self._lanes(q)

    def node_inputs(self, root_index, ancestors, nodes):
        """Node ``i`` sits in its lane's scratch slot ``i`` and sees the committed pairs up to its
        root's and its ancestors' scratch slots (``ancestors [B * lanes, T, T]``: a fixed tree's
        every node, or the ``T`` nodes an EAGLE-2 tree has grown so far)."""
        queries, width = nodes.shape[0], ancestors.shape[-1]
        slots = self._scratch[:, nodes]
        own = ancestors[:, nodes, :] & self._not_root[:width]  # the root is a committed pair, seen below
        mask = torch.zeros(self.batch, queries, self.cache_length, dtype=torch.bool, device=slots.device)
        mask.scatter_(2, self._scratch[:, None, :width].expand(-1, queries, -1), own)
        return slots, mask | self._committed_before(root_index)

    def _committed_before(self, root_index: torch.Tensor) -> torch.Tensor:
        """``[B * lanes, 1, cache_length]``: the committed pairs up to each lane's root in raster
        order. The same for every level of one tree; a compiled step computes it once (the
        compiler merges the levels' identical ops), an eager one once per level (a few small ops,
        against keeping a tensor between calls, which a step compiled as one graph cannot)."""
        lanes_cached = self.cached.repeat_interleave(self.lanes, 0, output_size=self.batch)
        return lanes_cached[:, None, :] & (self._raster_of_slot <= root_index[:, None, None])

    def propose(self, roots, root_index, greedy: bool) -> DraftTree:
        tree = super().propose(roots, root_index, greedy)
        first = (root_index + 1) % self.grid == 0  # a row's first step: its bonus token alone
        tree.valid = tree.valid & ~(first[:, None] & (tree.depth > 0))
        return tree

    def catch_up(self, features, tokens, first, count, keep: bool = True):
        """Pairs ``first .. first + count - 1`` of each lane go to their raster slots (the rest of
        the width to the spill slot); each sees the committed pairs before it."""
        width = tokens.shape[1]
        offsets = torch.arange(width, device=tokens.device)
        real = offsets < count[:, None]
        raster = torch.where(real, first[:, None] + offsets, -1)
        slots = torch.where(real, raster, self.spill)
        self.cached.scatter_(1, self._images(slots), self._images(real))  # the spill slot: only ever False
        mask = self.cached[:, None, :] & (self._raster_of_slot <= self._images(raster)[:, :, None])
        mask.scatter_(2, self._images(slots)[:, :, None], True)  # each pair sees itself
        feats, q = self.expand(features, tokens, raster.clamp(min=0, max=self.num_tokens - 1), slots,
                               self._lanes(mask))
        return self._root(feats, q, count, keep)
