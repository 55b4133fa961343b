"""COOL-SD (arXiv 2601.09212): relaxed acceptance with weights annealed over draft depth,
``w_i = delta exp(-nu i - mu)``, and the optimal residual."""

from __future__ import annotations

from relaxspec.acceptance import CoolRule
from relaxspec.errors import RelaxspecError
from relaxspec.methods.base import Method, Preset, Setting

COOL_DELTA = Setting("cool_delta", float, 1.1, "COOL-SD relaxation strength delta (default 1.1)")
NU = Setting("nu", float, 0.7, "COOL-SD annealing rate nu (default 0.7)")
NORMALISATION = Setting("normalisation", str, "mean", "COOL-SD schedule normalisation mu (default mean)",
                        choices=("mean", "none"))


class Cool(Method):
    name = "cool"
    summary = "COOL-SD: annealed w_i = delta exp(-nu i - mu), optimal residual"
    settings = (COOL_DELTA, NU, NORMALISATION)
    drafts = ("static", "chain", "dynamic")
    relaxed = True
    presets = {"cool": Preset({"draft": "static", "tree": "naive_extend_57", "siblings": "sampled", "cool_delta": 1.1},
                              "COOL-SD: annealed w_i = delta exp(-nu i - mu), delta=1.1, static 57-node tree",
                              spellings=("cool-sd",))}

    def resolve(self, options) -> None:
        super().resolve(options)
        if options.cool_delta <= 0:
            raise RelaxspecError(f"COOL-SD delta must be > 0, got {options.cool_delta}")

    def rule(self, options, context, horizon: int = 5):
        return CoolRule(delta=options.cool_delta, nu=options.nu, normalisation=options.normalisation, horizon=horizon)


METHODS = (Cool(),)
