"""Janus / Janus-Pro (transformers' ``JanusForConditionalGeneration``): prompts formatted by the
folder's processor and chat template (:mod:`relaxspec.models.janus`)."""

from relaxspec.pipelines.folders import FolderPipeline


class JanusPipeline(FolderPipeline):
    family = "Janus"
    MODEL = "relaxspec.models.janus"
    usage = "a Janus / Janus-Pro target: relaxspec generate --model-path DIR --prompt TEXT"
