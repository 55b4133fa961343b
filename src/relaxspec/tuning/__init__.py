"""``relaxspec tune``: the fastest decoding setting for one model on this machine within a quality
budget (:mod:`relaxspec.tuning.search`; what a run is asked, :mod:`relaxspec.tuning.config`), the
budget logic (:mod:`relaxspec.tuning.budget`), the settings tried (:mod:`relaxspec.tuning.candidates`),
the folder's saved state and its checks (:mod:`relaxspec.tuning.state`) and what a run writes
(:mod:`relaxspec.tuning.report`; the preset file format is :mod:`relaxspec.pipelines.presets`)."""

from relaxspec.tuning.budget import Budget
from relaxspec.tuning.config import TuneConfig
from relaxspec.tuning.search import Tuner

__all__ = ["Budget", "TuneConfig", "Tuner"]
