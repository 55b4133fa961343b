"""Builders of tiny, format-identical models and files the tests share (never imported from a
test file): Janus, Emu3 and Flan-T5 folders; the Markov targets and fake tokenizers of the
engine's law tests; the emoji data set stand-in. and Lumina-mGPT's model and Chameleon tokenizer folders (``helpers.lumina``)."""

from helpers.emu3 import emu3_folder_at
from helpers.janus import janus_folder_at
from helpers.t5 import make_t5

__all__ = ["emu3_folder_at", "janus_folder_at", "make_t5"]
