"""LANTERN (arXiv 2410.03355) and LANTERN++ (arXiv 2502.06352): relaxed acceptance over the
``k`` nearest codes of the VQ codebook, with an additive TV budget ``delta`` or a
multiplicative bound ``lam``."""

from __future__ import annotations

from pathlib import Path

from relaxspec.caching import PerObject
from relaxspec.acceptance import LanternRule, cached_neighbour_table, cool_weights
from relaxspec.acceptance.neighbours import default_cache_dir, load_neighbour_file
from relaxspec.files import file_identity, missing_file
from relaxspec.errors import RelaxspecError
from relaxspec.methods.base import Method, Preset, Setting
from relaxspec.methods.cool import NORMALISATION, NU

K = Setting("k", int, None, "LANTERN: latent neighbours per token (default 1000, 10 with --lam)")
DELTA = Setting("delta", float, None, "LANTERN: additive TV budget in [0, 1] (default 0.1)")
LAM = Setting("lam", float, None, "LANTERN++: multiplicative bound >= 1 (default 5 on a static tree)")
RESIDUAL = Setting("residual", str, "relaxed", "LANTERN: resample from the relaxed or the plain residual",
                   choices=("relaxed", "plain"))
GEOMETRY = Setting("geometry", str, "raw", "LANTERN neighbour geometry: raw codebook or L2-normalised",
                   choices=("raw", "normalised"))
NEIGHBOURS = Setting("neighbours", str, None, "LANTERN: a neighbour table file instead of the one computed from the "
                                             "codebook: .npy [codes, >= k] of code ids, nearest first, self excluded "
                                             "(official LANTERN's vq_distances/top_{V-1}_indices.npy)", flag="--neighbours")
ANNEAL = Setting("anneal", bool, False, "LANTERN: anneal the additive budget over draft depth (COOL-SD's schedule, "
                                        "--nu / --normalisation)")


#: Neighbour tables per live tokenizer (keyed by geometry, k and the codebook's version).
_NEIGHBOURS = PerObject(kept=4)


class Lantern(Method):
    name = "lantern"
    summary = "LANTERN relaxed acceptance over latent neighbours (additive delta or multiplicative lam)"
    settings = (K, DELTA, LAM, RESIDUAL, GEOMETRY, NEIGHBOURS, ANNEAL, NU, NORMALISATION)
    drafts = ("dynamic", "chain", "static")
    relaxed = True
    # The two bounds are alternatives, and k is tuned with the bound: setting one in a later layer
    # drops the other and the earlier k (unless that layer sets k too).
    exclusive = {"delta": ("lam", "k"), "lam": ("delta", "k")}
    # k is left to the method's defaults (1000 with delta, 10 with lam), as in the official code.
    presets = {
        "lantern": Preset({"draft": "dynamic", "delta": 0.1},
                          "LANTERN: additive budget delta=0.1 over k=1000 latent neighbours, on EAGLE-2's dynamic tree"),
        "lantern++": Preset({"draft": "static", "tree": "naive_extend_57", "siblings": "sampled", "lam": 5.0},
                            "LANTERN++: multiplicative lam=5 over k=10 neighbours, official static 57-node tree (naive_extend_57)",
                            fixed=("draft",), spellings=("lanternpp",),
                            refuse={"delta": "--method lantern++ is the multiplicative rule (--lam); for an additive "
                                             "budget use --method lantern --draft static --delta D"}),
    }

    def resolve(self, options) -> None:
        super().resolve(options)
        if options.k is not None and options.k < 1:
            raise RelaxspecError(f"k (latent neighbours) must be >= 1, got {options.k} (k = 0 relaxes nothing: "
                                 "use --method sd for exact decoding)")
        if options.delta is not None and options.lam is not None:
            raise RelaxspecError("give LANTERN either --delta (additive budget) or --lam (multiplicative, LANTERN++), "
                                 "not both")
        if options.delta is None and options.lam is None:
            # Defaults of the official code: LANTERN++'s run script uses (k, lam) = (10, 5) on a
            # static tree; LANTERN's CLI default is (k, delta) = (1000, 0.1).
            if options.draft == "static":
                options.lam = 5.0
            else:
                options.delta = 0.1
        if options.delta is not None and not 0 <= options.delta <= 1:
            raise RelaxspecError(f"--delta is an additive TV budget in [0, 1], got {options.delta}")
        if options.lam is not None and options.lam < 1:
            raise RelaxspecError(f"--lam is a multiplicative bound >= 1, got {options.lam}")
        if options.k is None:
            options.k = 10 if options.lam is not None else 1000
        if options.anneal and options.delta is None:
            raise RelaxspecError("--anneal applies to LANTERN's additive budget: use it with --method lantern --delta D")

    def used(self, options) -> set[str]:
        # A table file replaces the codebook's geometry; without one, "neighbours" is not recorded
        # (runs recorded before the setting existed keep their identity).
        used = {"k", "residual", "anneal", "delta" if options.delta is not None else "lam",
                "neighbours" if options.neighbours is not None else "geometry"}
        if options.anneal:
            used |= {"nu", "normalisation"}
        return used

    def check_fits(self, options, context) -> None:
        super().check_fits(options, context)
        if options.neighbours is not None and context.tokenizer is not None:
            self.table(options, context.tokenizer)  # a table file is read and checked before the first decode

    def use_effective(self, options, context) -> None:
        super().use_effective(options, context)
        vq = context.tokenizer
        codes = None if vq is None else int(vq.raw_codebook.shape[0])
        if codes is not None and options.k is not None and options.k > codes - 1:
            options.use("k", codes - 1, f"--k {options.k:,}: the codebook has {codes:,} codes, so each has "
                                        f"{codes - 1:,} neighbours; k = {codes - 1:,} is used")

    def table(self, options, vq):
        """The ``[V, k]`` neighbour table of ``vq``'s codebook this run uses (computed, or the
        ``neighbours`` file), kept per live tokenizer; and ``k`` (at most the codebook size - 1)."""
        raw = vq.raw_codebook
        k = min(options.k, raw.shape[0] - 1)
        if options.neighbours is not None:  # the user's table (LANTERN's file): read once per file and tokenizer
            path = Path(options.neighbours)
            if missing_file(path):
                raise RelaxspecError(f"--neighbours {path}: {missing_file(path)}")
            key = ("file", str(path.resolve()), str(file_identity(str(path))), k, raw.shape[0])
            return _NEIGHBOURS.get(vq, key, lambda: load_neighbour_file(path, raw.shape[0], k)), k

        def computed():  # read from the codebook (a device read) and the disk cache once per tokenizer
            codebook = raw if options.geometry == "raw" else vq.codebook
            return cached_neighbour_table(codebook.detach().float().cpu(), k, options.geometry, default_cache_dir())

        return _NEIGHBOURS.get(vq, (options.geometry, k, tuple(raw.shape), raw._version), computed), k

    def rule(self, options, context, horizon: int = 5):
        vq = context.tokenizer
        if vq is None:
            raise RelaxspecError("LANTERN needs the VQ tokenizer (its codebook defines the latent neighbours)")
        table, k = self.table(options, vq)
        if options.anneal:
            # Budgets are TV masses (<= 1): capped, with the mean kept at delta (docs/METHODS.md).
            schedule = cool_weights(options.delta, options.nu, options.normalisation, horizon, cap=1.0)
            return LanternRule(table, k, delta_schedule=schedule, residual=options.residual)
        return LanternRule(table, k, delta=options.delta, lam=options.lam, residual=options.residual)


METHODS = (Lantern(),)
