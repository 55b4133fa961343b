"""``relaxspec tune``: the fastest decoding setting for one model on this machine within a quality
budget (:mod:`relaxspec.tuning.search`), the budget logic (:mod:`relaxspec.tuning.budget`), the
settings tried (:mod:`relaxspec.tuning.candidates`) and what a run writes
(:mod:`relaxspec.tuning.report`; the preset file format is :mod:`relaxspec.pipelines.presets`)."""

from relaxspec.tuning.budget import Budget
from relaxspec.tuning.search import TuneConfig, Tuner

__all__ = ["Budget", "TuneConfig", "Tuner"]
