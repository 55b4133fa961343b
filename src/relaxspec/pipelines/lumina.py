"""Lumina-mGPT (a Chameleon language model with Meta's Chameleon VQGAN): the model folder as
published and Meta's Chameleon tokenizer folder (``--tokenizer-path``); prompts in the official
template, forced new lines, pixels as the official code converts them
(:mod:`relaxspec.models.lumina`, docs/models/lumina-mgpt.md)."""

from relaxspec.pipelines.folders import FolderPipeline


class LuminaPipeline(FolderPipeline):
    family = "Lumina-mGPT"
    MODEL = "relaxspec.models.lumina"
    usage = "a Lumina-mGPT target: relaxspec generate --model-path DIR --tokenizer-path CHAMELEON_TOKENIZER_DIR --prompt TEXT"
