"""GSD, grouped speculative decoding (arXiv 2508.07747, ICCV 2025): training-free relaxed
acceptance over a group of near-equivalent tokens built around each draft
(:class:`relaxspec.acceptance.gsd.GroupRule`). Its own setting drafts with the Jacobi window
(no drafter); the EAGLE drafter's structures work too."""

from __future__ import annotations

from relaxspec.acceptance.gsd import GroupRule
from relaxspec.errors import RelaxspecError
from relaxspec.methods.base import EAGLE_DRAFTS, JACOBI, Method, Preset, Setting

GROUP_RANKS = Setting("group_ranks", int, 7, "GSD: candidates are this many ranks below a draft in the target's "
                                             "ranking and one fewer above (default 7, the published code's)", minimum=0)
GROUP_P_GAP = Setting("group_p_gap", float, 0.15, "GSD: keep candidates whose probability is within this of the "
                                                  "draft's (default 0.15)", minimum=0)
GROUP_DISTANCE = Setting("group_distance", float, 0.5, "GSD: keep candidates whose squared L2 embedding distance to "
                                                       "the draft is below this (default 0.5)", minimum=0)
GROUP_LATENT = Setting("group_latent", str, "embedding", "GSD: the vectors of the distance test: the target's input "
                                                         "token embeddings (the published code's) or the VQ codebook",
                       choices=("embedding", "codebook"))


class GSD(Method):
    name = "gsd"
    summary = "GSD: grouped acceptance min(1, sum_C p / sum_C q) over tokens near the draft; no drafter needed"
    settings = (GROUP_RANKS, GROUP_P_GAP, GROUP_DISTANCE, GROUP_LATENT)
    drafts = (JACOBI, *EAGLE_DRAFTS)
    relaxed = True
    presets = {"gsd": Preset({"draft": JACOBI, "window": 16},
                             "GSD: grouped acceptance (7 ranks, p gap 0.15, distance 0.5) on the Jacobi window of 16, "
                             "no drafter")}

    def check_fits(self, options, context) -> None:
        super().check_fits(options, context)
        vocab = getattr(getattr(context.target, "config", None), "vocab_size", None)
        if vocab is not None and options.group_ranks >= vocab:
            raise RelaxspecError(f"--group-ranks {options.group_ranks:,}: this model has {vocab} image tokens, so at "
                                 f"most {vocab - 1} ranks lie below a draft")

    def rule(self, options, context, horizon: int = 5):
        vq, target = context.tokenizer, context.target
        if options.group_latent == "codebook":
            if vq is None:
                raise RelaxspecError("GSD with --group-latent codebook needs the VQ tokenizer")
            vectors, owner = vq.codebook, vq
        else:
            if target is None:
                raise RelaxspecError("GSD needs the target model (its token embeddings define the groups)")
            vectors, owner = target.token_embeddings, target
        # The owner keys the closeness table, so a second decode of the same model reuses it.
        return GroupRule(vectors, options.group_ranks, options.group_p_gap, options.group_distance, owner=owner)


METHODS = (GSD(),)
