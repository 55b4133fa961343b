"""Lumina-mGPT (a Chameleon language model with Meta's Chameleon VQGAN): the model folder as
published and Meta's Chameleon tokenizer folder (``--tokenizer-path``); prompts in the official
template, forced new lines, pixels as the official code converts them
(:mod:`relaxspec.models.lumina`, docs/models/lumina-mgpt.md)."""

from relaxspec.pipelines.families import OpeningInput
from relaxspec.pipelines.folders import FolderPipeline
from relaxspec.models.lumina import to_uint8


class LuminaPipeline(FolderPipeline):
    family = "Lumina-mGPT"
    MODEL = "relaxspec.models.lumina"
    inputs = (OpeningInput("tokenizer_path", "Meta's Chameleon tokenizer folder (text_tokenizer.json, vqgan.yaml, "
                                             "vqgan.ckpt)", needs="pyyaml"),)
    usage = "a Lumina-mGPT target: relaxspec generate --model-path DIR --tokenizer-path CHAMELEON_TOKENIZER_DIR --prompt TEXT"

    def to_uint8(self, decoded):
        """Pixels as the official code converts them (:func:`relaxspec.models.lumina.to_uint8`)."""
        return to_uint8(decoded).cpu().numpy()
