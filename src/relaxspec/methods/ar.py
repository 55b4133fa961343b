"""Plain autoregressive sampling: the baseline every speed-up is measured against."""

from __future__ import annotations

from relaxspec.methods.base import Method, Preset


class AR(Method):
    name = "ar"
    summary = "plain autoregressive sampling (the baseline, MAL 1.0)"
    drafts = ()
    presets = {
        "ar": Preset({}, "plain autoregressive sampling (the baseline, MAL 1.0)"),
        "ar-compiled": Preset({"compile": True}, "plain AR with its step compiled (CUDA graphs on a GPU): the "
                                                 "baseline a method must beat", bench=False, fixed=("compile",)),
    }

    def needs_drafter(self, options) -> bool:
        return False


METHODS = (AR(),)
