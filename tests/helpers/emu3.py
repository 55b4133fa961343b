"""A tiny random Emu3 and its processor, saved as save_pretrained writes a downloaded model."""

from __future__ import annotations

import torch

CODES, GRID = 48, 4
SPECIAL = ["<|endoftext|>", "<|extra_203|>", "<|extra_204|>", "<unk>", "<image>", "<|image start|>", "<|image end|>",
           "<|image token|>", "<|extra_200|>", "<|extra_201|>"]
WORDS = SPECIAL + list("0123456789*,.") + ("a red fox lighthouse blue cat dog under the rain lowres bad anatomy text "
                                           "error blurry").split()
VOCAB = {w: i for i, w in enumerate(WORDS + [f"<|visual token {i:06d}|>" for i in range(CODES)])}
PROMPTS = ["a red fox", "the blue cat under the rain", "a lighthouse"]
NEGATIVE = "lowres, bad anatomy, text error, blurry."


def tiny_emu3():
    from transformers import Emu3Config, Emu3ForConditionalGeneration, Emu3TextConfig

    text = Emu3TextConfig(vocab_size=len(VOCAB) + 3, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
                          pad_token_id=VOCAB["<|endoftext|>"], bos_token_id=VOCAB["<|extra_203|>"],
                          eos_token_id=VOCAB["<|extra_204|>"])
    vq = dict(codebook_size=CODES, embed_dim=4, latent_channels=4, base_channels=32, channel_multiplier=[1, 2],
              num_res_blocks=1, attn_resolutions=[], hidden_size=64, temporal_downsample_factor=4)
    torch.manual_seed(0)
    model = Emu3ForConditionalGeneration(Emu3Config(text_config=text.to_dict(), vq_config=vq,
                                                    vocabulary_map=VOCAB)).eval()
    with torch.no_grad():  # sharper laws than random init gives, so greedy paths differ between prompts
        model.lm_head.weight.mul_(8.0)
    model.generation_config.guidance_scale = 3.0  # what a Gen checkpoint's generation config sets
    return model


def tiny_processor():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Emu3ImageProcessor, Emu3Processor, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(),
                                                       pre_tokenizers.Digits(individual_digits=True)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|extra_203|>", eos_token="<|extra_204|>",
                                   pad_token="<|endoftext|>", unk_token="<unk>", extra_special_tokens={
                                       "image_token": "<image>", "boi_token": "<|image start|>",
                                       "eoi_token": "<|image end|>", "image_wrapper_token": "<|image token|>",
                                       "eof_token": "<|extra_201|>"})
    return Emu3Processor(image_processor=Emu3ImageProcessor(), tokenizer=fast)


def emu3_folder_at(folder):
    """A tiny Emu3 with its processor saved in ``folder``; returns the folder."""
    tiny_processor().save_pretrained(folder)
    tiny_emu3().save_pretrained(folder)
    return folder


def adapter(folder, prompts=PROMPTS, negative=NEGATIVE):
    """The target and tokenizer for ``prompts``, and their conditions, as a user builds them."""
    from relaxspec.models.emu3 import format_prompts, load_emu3

    cond, grid = format_prompts(tiny_processor(), prompts, image_size=GRID * 8, negative_prompt=negative)
    target, tokenizer = load_emu3(folder, cond.shape[2], grid)
    return target, tokenizer, cond
