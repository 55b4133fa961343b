"""The LlamaGen family's own training recipes: a VQ tokenizer (:mod:`.vq`, ``relaxspec
train-vq``) and a class-conditional transformer on its tokens (:mod:`.gpt`, ``relaxspec
train-gpt``), how the embedded emoji model was made. Drafters for any family are trained by
:mod:`relaxspec.training.drafter`."""
