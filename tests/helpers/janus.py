"""A tiny random Janus and its processor, saved as save_pretrained writes a downloaded model."""

from __future__ import annotations

import torch

BOS, BOI, PAD = 1, 6, 0


def tiny_janus():
    from transformers import JanusConfig, JanusForConditionalGeneration, LlamaConfig
    from transformers.models.janus.configuration_janus import JanusVisionConfig, JanusVQVAEConfig

    text = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=64, max_position_embeddings=256, bos_token_id=BOS,
                       pad_token_id=PAD, eos_token_id=2)
    vision = JanusVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=32, patch_size=8, projection_dim=32, depth=1, num_image_tokens=16)
    vq = JanusVQVAEConfig(embed_dim=8, num_embeddings=48, base_channels=32, channel_multiplier=[1, 2],
                          num_res_blocks=1, latent_channels=8, resolution=32, in_channels=3, out_channels=3,
                          projection_dim=32, image_token_embed_dim=32, num_patches=4)
    torch.manual_seed(0)
    model = JanusForConditionalGeneration(JanusConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                                      vq_config=vq.to_dict(), image_token_id=5)).eval()
    with torch.no_grad():  # sharper laws than random init gives, so greedy paths differ between prompts
        model.model.generation_head.proj_out.weight.mul_(6.0)
    model.generation_config.generation_kwargs = {"boi_token_id": BOI}
    model.generation_config.pad_token_id, model.generation_config.bos_token_id = PAD, BOS
    return model


#: Prompts as token ids, left-padded to 7 (BOS ... BOI, as the processor's image mode ends them).
PROMPTS = torch.tensor([[PAD, PAD, BOS, 10, 11, 12, BOI], [BOS, 20, 21, 22, 23, 24, BOI], [PAD, PAD, PAD, BOS, 30, 31, BOI]])


WORDS = ["<pad>", "<bos>", "<eos>", "<unk>", "<image_placeholder>", "<begin_of_image>", "<end_of_image>", "<|User|>",
         "<|Assistant|>", ":"] + "a red fox lighthouse blue cat dog under the rain".split()
TEMPLATE = ("{% for m in messages %}<|User|>: {% for c in m['content'] %}{{ c['text'] }}{% endfor %}\n{% endfor %}"
            "{% if add_generation_prompt %}<|Assistant|>:{% endif %}")


def tiny_janus_processor():
    """Janus's processor over a word-level tokenizer that prepends BOS, with Janus's special
    tokens and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import JanusImageProcessor, JanusProcessor, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", extra_special_tokens={
                                       "image_token": "<image_placeholder>", "boi_token": "<begin_of_image>",
                                       "eoi_token": "<end_of_image>"})
    return JanusProcessor(image_processor=JanusImageProcessor(), tokenizer=fast, chat_template=TEMPLATE,
                          num_image_tokens=16)


def janus_folder_at(folder):
    """A tiny Janus with its processor saved in ``folder`` as save_pretrained writes a downloaded
    model; returns the model."""
    vocab = {w: i for i, w in enumerate(WORDS)}
    tiny_janus_processor().save_pretrained(folder)
    model = tiny_janus()
    model.generation_config.generation_kwargs = {"boi_token_id": vocab["<begin_of_image>"]}
    model.generation_config.pad_token_id, model.generation_config.bos_token_id = vocab["<pad>"], vocab["<bos>"]
    model.save_pretrained(folder)
    return model
