"""The drafter-free Jacobi baselines: speculative Jacobi decoding (SJD, arXiv 2410.01699), its
maximally coupled variant (SCD-style, arXiv 2510.24211) and SJD-PAC (arXiv 2603.18599: SCD's
coupling with a proactive tree of siblings at the first positions). All are exact."""

from __future__ import annotations

from relaxspec.drafting.jacobi import JacobiSource, chain_length, least_window, window_layout
from relaxspec.errors import RelaxspecError
from relaxspec.methods.base import JACOBI, Method, Preset, Setting, draft_source

TREE_WIDTH = Setting("tree_width", int, 3, "sjd-pac: siblings drafted at each of the proactive tree's positions (the "
                                           "official code's tree_width, default 3; 1: no tree, SCD)", minimum=1)
TREE_DEPTH = Setting("tree_depth", int, 3, "sjd-pac: levels of the proactive tree counting its root (the official "
                                           "code's tree_depth, default 3: siblings at the first two positions)",
                     minimum=1)

SJD_PAC_RULES = Setting("sjd_pac_rules", str, "exact",
                        "sjd-pac: 'exact' (the model's law: siblings drawn from the position's law, the first accepted "
                        "one taken) or 'official' as its code (siblings drawn from the residual, every node tested, "
                        "the longest accepted path taken: not the model's law, docs/METHODS.md)",
                        choices=("exact", "official"))


class SJD(Method):
    name = "sjd"
    summary = "speculative Jacobi decoding: a window of future tokens, no drafter"
    drafts = (JACOBI,)
    presets = {"sjd": Preset({"window": 16}, "speculative Jacobi decoding, window 16, no drafter")}


class SCD(Method):
    name = "scd"
    summary = "SJD with maximally coupled redraws (SCD-style), no drafter"
    drafts = (JACOBI,)
    presets = {"scd": Preset({"window": 16}, "SJD with maximally coupled redraws (SCD-style), window 16, no drafter")}

    def source(self, options, context):
        return draft_source(self, options, context.drafter, context.sampling, coupled=True)


class SJDPAC(Method):
    """SJD-PAC (arXiv 2603.18599, code github.com/KangJialiang/SJD-PAC): a Jacobi window whose first
    ``tree_depth - 1`` positions hold ``tree_width`` siblings each (proactive drafting) and whose
    redraws keep a draft where it passes against its new law (adaptive continuation: SCD's
    maximal coupling). The window counts the tree's drafts: the official 64 nodes a forward are
    63 drafts and the root, a chain of 53 past the root with width 3 and depth 3; a chain longer
    than the model's images is shortened to them (its window, less). The siblings after the first
    are the next draws from the position's law without replacement (the official code draws them
    from the residual, which is not the law it verifies them against, and commits the longest
    accepted path: ``--sjd-pac-rules official``, preset ``sjd-pac-official``, docs/METHODS.md)."""

    name = "sjd-pac"
    summary = "SJD-PAC: a Jacobi window with a proactive tree of siblings and coupled redraws, exact, no drafter"
    drafts = (JACOBI,)
    settings = (TREE_WIDTH, TREE_DEPTH, SJD_PAC_RULES)
    presets = {"sjd-pac": Preset({"window": 63}, "SJD-PAC, exact: 63 drafts a forward (64 nodes with the root), a "
                                                 "proactive tree of width 3 and depth 3, coupled redraws, no drafter",
                                 spellings=("sjdpac", "pac")),
               "sjd-pac-official": Preset({"window": 63, "sjd_pac_rules": "official"},
                                          "SJD-PAC as its code samples (siblings from the residual, the longest "
                                          "accepted path): not the model's law, its TV not recorded; for comparison "
                                          "with the paper", bench=False)}

    def resolve(self, options) -> None:
        super().resolve(options)
        window_layout(options.window, options.tree_width, options.tree_depth)  # the tree fits in the window
        if options.sjd_pac_rules == "official" and options.rows > 1:
            raise RelaxspecError("--sjd-pac-rules official paints in raster order (its code's walk); rows in "
                                 "parallel take the exact rules")

    def check_fits(self, options, context) -> None:
        config = getattr(context.target, "config", None)
        tokens = getattr(config, "block_size", None)
        if tokens is not None and options.tree_depth - 1 > tokens:
            raise RelaxspecError(f"--tree-depth {options.tree_depth:,} puts siblings at {options.tree_depth - 1:,} "
                                 f"positions; this model's images have {tokens}: at most {tokens + 1}")
        if options.rows > 1:  # (a window past the image is cut to it, not refused: the base's check is not made)
            self._check_rows(options, context)

    def use_effective(self, options, context) -> None:
        super().use_effective(options, context)
        window = self.window_on(options, context.target)
        if window < options.window:
            options.use("window", window, f"--window {options.window:,}: this model's images have "
                                          f"{context.target.config.block_size} tokens, so the chain past the tree is "
                                          f"cut to them; a window of {window:,} is used")

    @staticmethod
    def window_on(options, target) -> int:
        """``options.window`` with its chain cut to ``target``'s image tokens (every draft past
        them is never tested)."""
        tokens = getattr(getattr(target, "config", None), "block_size", None)
        chain = chain_length(options.window, options.tree_width, options.tree_depth)
        if tokens is None or chain <= tokens:
            return options.window
        return max(options.window - (chain - tokens), least_window(options.tree_width, options.tree_depth))

    def source(self, options, context):
        return JacobiSource(self.window_on(options, context.target), coupled=True, width=options.tree_width,
                            depth=options.tree_depth, official=options.sjd_pac_rules == "official")


METHODS = (SJD(), SCD(), SJDPAC())
