"""LlamaGen's published checkpoint layout, written out independently of the model code."""

from __future__ import annotations

def gpt_b_expected_shapes(model_type: str = "c2i") -> dict[str, tuple]:
    """Written out from REFERENCE §2.3 / §2.1, independently of the model code."""
    expected = {"tok_embeddings.weight": (16384, 768), "norm.weight": (768,), "output.weight": (16384, 768)}
    if model_type == "c2i":
        expected["cls_embedding.embedding_table.weight"] = (1001, 768)
    else:
        expected.update({"cls_embedding.uncond_embedding": (120, 2048), "cls_embedding.cap_proj.fc1.weight": (768, 2048),
                         "cls_embedding.cap_proj.fc2.weight": (768, 768)})
    for i in range(12):
        expected.update({
            f"layers.{i}.attention.wqkv.weight": (2304, 768), f"layers.{i}.attention.wo.weight": (768, 768),
            f"layers.{i}.feed_forward.w1.weight": (2048, 768), f"layers.{i}.feed_forward.w3.weight": (2048, 768),
            f"layers.{i}.feed_forward.w2.weight": (768, 2048),
            f"layers.{i}.attention_norm.weight": (768,), f"layers.{i}.ffn_norm.weight": (768,),
        })
    return expected
