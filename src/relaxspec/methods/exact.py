"""Exact speculative decoding with the EAGLE drafter (arXiv 2211.17192; EAGLE 2401.15077,
EAGLE-2 2406.16858): the output law is the model's."""

from __future__ import annotations

from relaxspec.methods.base import Method, Preset


class Exact(Method):
    name = "sd"
    summary = "exact speculative decoding with the EAGLE drafter: chain, static or dynamic tree"
    presets = {
        "sd": Preset({}, "exact speculative decoding, EAGLE drafter, chain of 4", bench=False),
        "sd-chain": Preset({"draft": "chain", "depth": 4}, "exact speculative decoding, EAGLE drafter, chain of 4",
                           fixed=("draft",)),
        "sd-static": Preset({"draft": "static", "tree": "naive_extend_57", "siblings": "sampled"},
                            "exact speculative decoding, static 57-node tree, sampled siblings (EAGLE-1 style)",
                            fixed=("draft",)),
        "eagle2": Preset({"draft": "dynamic", "dynamic_top_k": 10, "depth": 5, "total_tokens": 59},
                         "exact speculative decoding, EAGLE-2 dynamic tree (top-k 10, depth 5, 59 nodes)",
                         fixed=("draft",), spellings=("sd-dynamic", "eagle-2")),
    }


METHODS = (Exact(),)
