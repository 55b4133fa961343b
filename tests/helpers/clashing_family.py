"""A family whose opening input takes a name relaxspec's own options use (``device``): skipped."""

from relaxspec.pipelines import OpeningInput
from relaxspec.pipelines.folders import FolderPipeline


class ClashingPipeline(FolderPipeline):
    family = "Clashing"
    MODEL = "helpers.palette"
    inputs = (OpeningInput("device", "a clash", kind="text"),)
