"""Pipelines: one per model family, from the paths a user has to pixels
(:class:`ImagePipeline`); :func:`open_pipeline` is the front door.

>>> pipe = open_pipeline()                                  # doctest: +SKIP  (the embedded model)
>>> condition = pipe.conditions(classes="heart,time")       # doctest: +SKIP
>>> result = pipe.generate(condition, pipe.method("lantern"))   # doctest: +SKIP
>>> images = pipe.images(result.tokens, upscale=4)          # doctest: +SKIP
"""

from relaxspec.conditions import Condition
from relaxspec.pipelines.base import UPSTREAM_SAMPLING, ImagePipeline, PreparedDecode
from relaxspec.pipelines.families import OpeningInput
from relaxspec.pipelines.open import FOLDER_PIPELINES, open_pipeline

__all__ = ["Condition", "FOLDER_PIPELINES", "ImagePipeline", "OpeningInput", "PreparedDecode", "UPSTREAM_SAMPLING",
           "open_pipeline"]
