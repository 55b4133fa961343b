"""Distilling the drafter on the target's decoding laws (issue 22, item 1): the unrolled depths are
what decoding drafts, the per-depth ``1 - TV`` is the exact acceptance law's, the distillation
losses reach it, deeper training helps deeper drafts, and the run stops, keeps its best, exports
and resumes."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.engine import explicit_chain, peaked_target
from relaxspec.drafting.eagle import EagleDrafter, drafter_config, load_drafter
from relaxspec.errors import RelaxspecError
from relaxspec.models.llamagen.gpt import GPTConfig, Transformer
from relaxspec.sampling import SamplingConfig, process_logits
from relaxspec.training.drafter import (
    BEST,
    TRAIN_STATE,
    DrafterDataset,
    DrafterTrainConfig,
    drafter_loss,
    evaluate_drafter,
    sample_from_target,
    target_features,
    train_drafter,
    unrolled,
    unrolled_mask,
)

TINY = GPTConfig(dim=64, n_layer=2, n_head=4, vocab_size=64, num_classes=10, block_size=16)
GUIDED = SamplingConfig(cfg_scale=3.0, temperature=1.0)


@pytest.fixture(scope="module")
def target() -> Transformer:
    return peaked_target(TINY, head_scale=10.0)


@pytest.fixture(scope="module")
def dataset(target: Transformer) -> DrafterDataset:
    return sample_from_target(target, 24, sampling=GUIDED, seed=0)


def quick(out, **overrides) -> DrafterTrainConfig:
    fields = dict(out=str(out), steps=10, batch_size=4, lr=3e-3, warmup_steps=2, val_fraction=0.25, progress=False,
                  eval_interval=1000, checkpoint_interval=1000, cfg_scale=3.0, eval_depths=3)
    return DrafterTrainConfig(**{**fields, **overrides})


# ---------------------------------------------------------------------------------- the unrolled depths


def test_the_mask_of_two_levels_over_three_pairs() -> None:
    """Level 2 at pair i (the 2nd draft after committed pair i - 1) sees level 1 up to pair
    i - 1 and itself; pair 0 of level 2 has no chain and sees only itself."""
    want = torch.tensor([
        # level 1: pairs 0 1 2 | level 2: pairs 0 1 2
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [1, 0, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(unrolled_mask(3, 2), want)
    three = unrolled_mask(4, 3)  # level 3 at pair 3: level 1 <= pair 1, level 2 at pair 2, itself
    assert three[8 + 3].nonzero().flatten().tolist() == [0, 1, 4 + 2, 8 + 3]


@torch.no_grad()
def test_unrolled_depths_are_the_chain_decoding_drafts(target: Transformer, dataset: DrafterDataset) -> None:
    """Every (depth, pair) output of the parallel unrolled pass equals the chain run one draft at
    a time; the test can tell (an unmasked pass, where level d sees all of level 1, differs)."""
    torch.manual_seed(1)
    drafter = EagleDrafter(drafter_config(target, 2), target).attach(target).eval()
    tokens = dataset.tokens[:2]
    features, _ = target_features(target, tokens, dataset.labels[:2], null_rows=0)
    depths = 3
    _, logits = unrolled(drafter, features, tokens, depths)
    count = tokens.shape[1] - 1
    for depth in range(1, depths + 1):
        for pair in range(depth - 1, count):
            want = explicit_chain(drafter, features, tokens, pair - depth + 1, depth)
            torch.testing.assert_close(logits[:, depth - 1, pair], want, atol=1e-4, rtol=1e-4)
    loose = torch.ones(depths * count, depths * count, dtype=torch.bool).tril()
    in_features = features[:, :-1]
    shifted = torch.cat([torch.zeros_like(in_features[:, :1]), in_features[:, :-1]], dim=1)
    positions = torch.arange(count).expand(2, -1)
    _, wrong = drafter(torch.cat([in_features, shifted, shifted], 1), tokens[:, :-1].repeat(1, 3),
                       positions.repeat(1, 3), attn_mask=loose.expand(2, -1, -1))
    assert (wrong.reshape(2, depths, count, -1)[:, 1, 5:] - logits[:, 1, 5:]).abs().max() > 1e-2


# ---------------------------------------------------------------------------------- the laws


def test_accept_is_one_minus_tv_of_the_decoding_laws() -> None:
    """``accept`` is the mean of ``1 - TV`` between the guided, tempered, filtered laws (what
    exact acceptance is, REFERENCE §1.1); a drafter equal to the target scores 1 and loss 0."""
    torch.manual_seed(0)
    sampling = SamplingConfig(cfg_scale=2.5, temperature=0.8, top_k=5)
    target_logits = torch.randn(4, 6, 10) * 3  # [cond 2; null 2], 6 positions, vocab 10
    drafter_logits = torch.randn(4, 1, 6, 10) * 3
    features = torch.zeros(4, 1, 6, 8)
    got = drafter_loss(features, drafter_logits, features[:, 0], target_logits, law_loss="kl+tv", sampling=sampling)
    p, q = process_logits(target_logits, sampling), process_logits(drafter_logits[:, 0], sampling)
    want = 1 - 0.5 * (p - q).abs().sum(-1).mean()
    torch.testing.assert_close(got["accept"], want[None], atol=1e-6, rtol=0)
    torch.testing.assert_close(got["tv"], 1 - want, atol=1e-6, rtol=0)
    assert float(got["kl"]) > 0
    same = drafter_loss(features, target_logits[:, None], features[:, 0], target_logits, law_loss="kl+tv",
                        sampling=sampling)
    torch.testing.assert_close(same["accept"], torch.ones(1), atol=1e-6, rtol=0)
    assert abs(float(same["kl"])) < 1e-5 and float(same["loss"]) < 1e-5


def test_only_pairs_with_a_chain_count_at_each_depth() -> None:
    """At depth d the first d - 1 pairs have no chain: garbage there changes nothing."""
    torch.manual_seed(0)
    target_logits = torch.randn(2, 5, 7)
    drafter_logits = target_logits[:, None].repeat(1, 3, 1, 1)
    drafter_logits[:, 1, 0] = torch.randn(2, 7) * 50  # depth 2, pair 0
    drafter_logits[:, 2, :2] = torch.randn(2, 2, 7) * 50  # depth 3, pairs 0-1
    features = torch.zeros(2, 3, 5, 4)
    got = drafter_loss(features, drafter_logits, features[:, 0], target_logits, law_loss="kl",
                       sampling=SamplingConfig(cfg_scale=1.0))
    torch.testing.assert_close(got["accept"], torch.ones(3), atol=1e-6, rtol=0)
    assert float(got["chain_mal"]) == pytest.approx(4.0, abs=1e-5)


# ---------------------------------------------------------------------------------- training


def test_distillation_raises_acceptance_at_every_depth(tmp_path, target, dataset) -> None:
    config = quick(tmp_path / "kl", steps=80, eval_interval=40, law_loss="kl", train_depths=3)
    result = train_drafter(config, target=target, dataset=dataset)
    first, last = result.history[0], result.history[-1]
    assert len(first["accept"]) == len(last["accept"]) == 3
    for depth in range(3):
        assert last["accept"][depth] > first["accept"][depth] + 0.1, depth
    assert last["kl"] < 0.5 * first["kl"]
    assert last["chain_mal"] > first["chain_mal"]
    lines = [json.loads(line) for line in (tmp_path / "kl" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 40, 80] and lines[-1]["accept"] == last["accept"]
    pytest.importorskip("matplotlib")
    from PIL import Image

    with Image.open(tmp_path / "kl" / "accept.png") as plot:  # 1 - TV per depth against the steps
        assert plot.size[0] > 500


def test_training_the_deeper_depths_helps_the_deeper_drafts(tmp_path, target, dataset) -> None:
    """Same data, steps and seed: unrolled training (3 depths) drafts the 2nd and 3rd token
    better than training depth 1 alone, measured the same way."""
    shallow = train_drafter(quick(tmp_path / "one", steps=80, law_loss="kl", train_depths=1), target=target,
                            dataset=dataset)
    deep = train_drafter(quick(tmp_path / "three", steps=80, law_loss="kl", train_depths=3), target=target,
                         dataset=dataset)
    one, three = shallow.history[-1]["accept"], deep.history[-1]["accept"]
    assert three[1] > one[1] and three[2] > one[2], (one, three)


def test_the_best_is_kept_exported_and_patience_stops(tmp_path, target, dataset) -> None:
    # lr far too high: the chain MAL gets worse after the first evaluations, and patience stops it
    config = quick(tmp_path / "run", steps=200, eval_interval=5, law_loss="tv", lr=0.3, warmup_steps=0, patience=2,
                   export=str(tmp_path / "fp16"))
    result = train_drafter(config, target=target, dataset=dataset)
    assert result.stopped_early and result.step < 200
    scores = [record["chain_mal"] for record in result.history if record["step"] > 0]  # step 0: the baseline
    assert result.best["chain_mal"] == max(scores) and result.best["step"] > 0
    assert sum(record["best"] for record in result.history[-2:]) == 0  # two evaluations without a better one
    best = load_drafter(tmp_path / "run" / BEST, target)
    shipped = load_drafter(tmp_path / "fp16", target)
    assert shipped.fc.weight.dtype == torch.float32  # loaded in the target's dtype ...
    meta = json.loads((tmp_path / "fp16" / "config.json").read_text())
    assert meta["training"]["best"]["step"] == result.best["step"] and meta.get("dtype", "float16") == "float16"
    torch.testing.assert_close(shipped.fc.weight, best.fc.weight.half().float())  # ... from fp16 weights
    evaluated = evaluate_drafter(best, dataset.split(config.val_fraction, config.seed)[1], config)
    assert evaluated["chain_mal"] == pytest.approx(result.best["chain_mal"], abs=1e-6)
    # A stopped run resumed with the same patience does not train on; more patience continues it.
    again = train_drafter(quick(tmp_path / "run", steps=200, eval_interval=5, law_loss="tv", lr=0.3, warmup_steps=0,
                                patience=2), target=target, dataset=dataset, resume=True)
    assert again.step == result.step
    more = train_drafter(quick(tmp_path / "run", steps=result.step + 5, eval_interval=5, law_loss="tv", lr=0.3,
                               warmup_steps=0, patience=50), target=target, dataset=dataset, resume=True)
    assert more.step == result.step + 5


def test_a_distilled_run_resumes_exactly(tmp_path, target, dataset) -> None:
    overrides = dict(law_loss="kl+tv", train_depths=2, eval_interval=3)
    straight = train_drafter(quick(tmp_path / "a", steps=8, **overrides), target=target, dataset=dataset)
    train_drafter(quick(tmp_path / "b", steps=5, **overrides), target=target, dataset=dataset)
    resumed = train_drafter(quick(tmp_path / "b", steps=8, **overrides), target=target, dataset=dataset, resume=True)
    for key, value in straight.drafter.state_dict().items():
        assert torch.equal(value, resumed.drafter.state_dict()[key]), key
    # the same evaluations, and one more where the first part of the split run ended
    assert [r["step"] for r in resumed.history] == [0, 3, 5, 6, 8] and [r["step"] for r in straight.history] == [0, 3, 6, 8]
    # the split run's evaluation at 5 (where its first part ended) may win out/best but counts nothing
    # for patience, so split and whole runs stop at the same step
    for key in ("bad_evals", "scheduled_best"):
        assert torch.load(tmp_path / "a" / TRAIN_STATE, weights_only=True)[key] == \
            torch.load(tmp_path / "b" / TRAIN_STATE, weights_only=True)[key], key
    same = [r for r in resumed.history if r["step"] != 5]
    assert [r["accept"] for r in same] == [r["accept"] for r in straight.history]


def test_a_state_saved_before_distillation_resumes(tmp_path, target, dataset) -> None:
    """A train state written before these fields existed resumes as what it was (EAGLE's CE, one
    depth); asking it for another recipe is refused."""
    train_drafter(quick(tmp_path / "old", steps=3), target=target, dataset=dataset)
    path = tmp_path / "old" / TRAIN_STATE
    state = torch.load(path, weights_only=True)
    for name in ("law_loss", "distill_weight", "train_depths", "eval_depths", "patience", "export"):
        del state["config"][name]
    del state["best"], state["bad_evals"]
    torch.save(state, path)
    assert train_drafter(quick(tmp_path / "old", steps=5), target=target, dataset=dataset, resume=True).step == 5
    with pytest.raises(RelaxspecError, match="different recipe: law_loss"):
        train_drafter(quick(tmp_path / "old", steps=7, law_loss="kl"), target=target, dataset=dataset, resume=True)


@pytest.mark.parametrize("fields, message", [
    (dict(law_loss="js"), "law_loss must be one of ce, kl, tv, kl\\+tv"),
    (dict(law_loss="kl", temperature=0.0), "temperature > 0"),
    (dict(law_loss="tv", null_fraction=0.5), "null_fraction 1"),
    (dict(train_depths=0), "train_depths must lie in \\[1, 64\\], got 0"),
    (dict(train_depths=100000), "train_depths must lie in \\[1, 64\\], got 100,000"),  # it ran on, memory growing
    (dict(eval_depths=0), "eval_depths must lie in \\[1, 64\\]"),
    (dict(eval_depths=10**6), "eval_depths must lie in \\[1, 64\\]"),
    (dict(patience=-1), "patience must be >= 0"),
    (dict(distill_weight=-1.0), "distill_weight must be >= 0"),
    (dict(null_fraction=0.0), "null_fraction must be > 0"),
    (dict(law_loss="kl", feature_weight=0.0, distill_weight=0.0), "not both 0"),
])
def test_bad_distillation_settings_are_refused(tmp_path, fields, message) -> None:
    with pytest.raises(RelaxspecError, match=message):
        quick(tmp_path / "x", **fields)


def test_without_guidance_any_null_fraction_distils(tmp_path, target, dataset) -> None:
    config = quick(tmp_path / "plain", steps=2, law_loss="kl", cfg_scale=1.0, null_fraction=0.5)
    assert train_drafter(config, target=target, dataset=dataset).step == 2


@pytest.mark.parametrize("batch_size", [3, 4])
def test_part_of_the_batch_under_the_null_condition_measures_the_paired_rows(tmp_path, target, dataset, batch_size):
    """EAGLE's loss with only some sequences also under the null condition (an odd number of rows
    included) measures 1 - TV on the sequences that have both streams."""
    config = quick(tmp_path / "half", steps=2, null_fraction=0.5, batch_size=batch_size)
    result = train_drafter(config, target=target, dataset=dataset)
    assert all(0 <= a <= 1 for a in result.history[-1]["accept"])
