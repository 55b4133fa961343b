"""LlamaGen (arXiv 2406.06525), the first model family: its transformer (``gpt``: c2i / t2i,
named configs, 2D RoPE, a static KV cache addressed by slots, explicit tree masks), its VQ
tokenizer (``vq``) and its checkpoint formats (``checkpoints``: official files, whose configs are a
named size or JSON, relaxspec's GPT and VQ folders; reading and saving weights are every family's,
:mod:`relaxspec.models.weights`). ``Transformer`` implements
:class:`relaxspec.models.base.TargetModel` and ``VQModel``
:class:`relaxspec.models.base.ImageTokenizer`; the EAGLE drafter (:mod:`relaxspec.drafting.eagle`)
is built of LlamaGen blocks and loads from the same folder format."""
