"""relaxspec: exact and relaxed speculative decoding for visual autoregressive models.

The public API (see docs/API.md)::

    from relaxspec import load_gpt, load_vq, load_drafter, SamplingConfig, MethodOptions, decode

    target = load_gpt("c2i_B_256.pt", "GPT-B")
    vq = load_vq("vq_ds16_c2i.pt", "VQ-16")
    drafter = load_drafter("drafter/", target)
    result = decode(target, torch.tensor([207, 360]), SamplingConfig(cfg_scale=4.0, top_k=2000),
                    MethodOptions("lantern", delta=0.1, k=1000), drafter=drafter, vq=vq,
                    generator=torch.Generator().manual_seed(0))
    images = vq.decode(result.tokens)
"""

__version__ = "0.1.0"

_EXPORTS = {
    "generate": "relaxspec.api",
    "Generation": "relaxspec.api",
    "SamplingConfig": "relaxspec.sampling",
    "process_logits": "relaxspec.sampling",
    "MethodOptions": "relaxspec.methods",
    "DecodeResult": "relaxspec.decoding.result",
    "decode": "relaxspec.decoding",
    "generate_ar": "relaxspec.decoding.ar",
    "DecodePlan": "relaxspec.decoding",
    "verify_tree": "relaxspec.decoding.verify",
    "load_gpt": "relaxspec.models.llamagen.checkpoints",
    "load_vq": "relaxspec.models.llamagen.checkpoints",
    "save_model": "relaxspec.models.weights",
    "load_drafter": "relaxspec.drafting.eagle",
    "Transformer": "relaxspec.models.llamagen.gpt",
    "GPTConfig": "relaxspec.models.llamagen.gpt",
    "VQModel": "relaxspec.models.llamagen.vq",
    "EagleDrafter": "relaxspec.drafting.eagle",
    "TreeSpec": "relaxspec.drafting.trees",
    "build_tree": "relaxspec.drafting.trees",
    "ExactRule": "relaxspec.acceptance",
    "LanternRule": "relaxspec.acceptance",
    "CoolRule": "relaxspec.acceptance",
    "RelaxspecError": "relaxspec.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    # Lazy, so `import relaxspec` (and the CLI's start-up) does not import torch-heavy modules
    # it does not use.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'relaxspec' has no attribute {name!r}")
