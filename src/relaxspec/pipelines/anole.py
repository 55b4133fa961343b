"""Anole (Chameleon tuned for image generation; ``leloy/Anole-7b-v0.1-hf``): one transformers folder
with the language model, the VQ model and the text tokenizer; prompts as the official generation
builds them, pixels as the official code converts them (:mod:`relaxspec.models.anole`,
docs/models/anole.md). A Chameleon folder is Anole's when its weights hold the VQ decoder;
Lumina-mGPT's share the model type and have none."""

from relaxspec.pipelines.folders import FolderPipeline
from relaxspec.models.anole import is_anole_folder, to_uint8


class AnolePipeline(FolderPipeline):
    family = "Anole"
    MODEL = "relaxspec.models.anole"
    usage = "an Anole target: relaxspec generate --model-path DIR --prompt TEXT"

    @staticmethod
    def claims(path) -> bool:
        return is_anole_folder(path)

    def to_uint8(self, decoded):
        """Pixels as the official code converts them (:func:`relaxspec.models.anole.to_uint8`)."""
        return to_uint8(decoded).cpu().numpy()
