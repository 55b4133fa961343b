"""A tiny random Flan-T5-shaped encoder folder, as save_pretrained writes it."""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = ["<pad>", "</s>", "<unk>"] + "a an the red blue green cat dog heart on of in with small big , .".split()


def make_t5(folder: Path, d_model: int, safetensors: bool = True) -> Path:
    """A T5 encoder with random weights and a word-level tokenizer that appends </s>, in the
    folder layout save_pretrained writes (what a user downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)
    torch.manual_seed(0)
    config = T5Config(vocab_size=len(WORDS), d_model=d_model, d_kv=8, d_ff=64, num_layers=2, num_heads=2,
                      pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    model = T5EncoderModel(config)
    model.save_pretrained(folder)
    if not safetensors:  # the older pickled layout (pytorch_model.bin), which relaxspec does not unpickle
        for path in folder.glob("*.safetensors"):
            path.unlink()
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return folder
