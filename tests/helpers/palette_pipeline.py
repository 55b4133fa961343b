"""The toy Palette family's pipeline file (:mod:`helpers.palette`): what users read, its model
module, and its own opening input."""

from relaxspec.pipelines import OpeningInput
from relaxspec.pipelines.folders import FolderPipeline


class PalettePipeline(FolderPipeline):
    family = "Palette"
    MODEL = "helpers.palette"
    usage = "a Palette target: relaxspec generate --model-path DIR --palette-path FILE --prompt TEXT"
    inputs = (OpeningInput("palette_path", "the JSON list of RGB colours its image tokens decode to",
                           metavar="FILE"),)
