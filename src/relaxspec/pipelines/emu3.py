"""Emu3 (transformers' ``Emu3ForConditionalGeneration``): prompts and a negative prompt formatted
by the folder's processor, forced end-of-line rows (:mod:`relaxspec.models.emu3`)."""

from relaxspec.pipelines.families import OpeningInput
from relaxspec.pipelines.folders import FolderPipeline


class Emu3Pipeline(FolderPipeline):
    family = "Emu3"
    MODEL = "relaxspec.models.emu3"
    inputs = (OpeningInput("negative_prompt", "the guidance's negative prompt (default: transformers' Emu3 "
                                              "example's; \"\" = none, the prompt's last token is the unconditional "
                                              "context, as transformers without one)", kind="text", metavar="TEXT"),)
    usage = "an Emu3 target (its Gen checkpoints): relaxspec generate --model-path DIR --prompt TEXT"
