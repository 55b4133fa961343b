"""The ambiguity diagnostic measures the same processed distributions decoding samples from."""

import torch

from relaxspec.bench.ambiguity import ambiguity_report, processed_distributions
from relaxspec.decoding.ar import generate_ar
from relaxspec.models.llamagen.gpt import GPTConfig, Transformer
from relaxspec.sampling import SamplingConfig


def tiny_model(scale: float = 3.0) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(GPTConfig(dim=32, n_layer=1, n_head=2, vocab_size=16, num_classes=3, block_size=4)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model


def test_teacher_forced_laws_match_decoding():
    model = tiny_model()
    sampling = SamplingConfig(cfg_scale=2.0, temperature=0)
    cond = torch.tensor([0, 1, 2])
    tokens = generate_ar(model, cond, sampling).tokens
    probs = processed_distributions(model, cond, tokens, sampling)
    assert torch.equal(probs.argmax(-1), tokens)  # greedy tokens are the argmax of these laws


def test_report_is_consistent():
    model = tiny_model()
    report = ambiguity_report(model, [0, 1], SamplingConfig(cfg_scale=1.5, top_k=8), samples_per_class=3)
    assert report["tokens"] == 2 * 3 * 4
    q = list(report["top1_quantiles"].values())
    assert q == sorted(q) and 1 / 8 - 1e-6 <= q[0] <= q[-1] <= 1  # top-k 8 keeps 8 tokens at most
    assert report["entropy_mean_nats"] <= torch.log(torch.tensor(8.0)).item() + 1e-5
    assert sum(report["top1_histogram"]["counts"]) == report["tokens"]
