"""Image-quality metrics as pure functions over features, logits and labels.

The papers (REFERENCE §3) report FID with Inception features, precision/recall (k = 3) and CLIP
score. No such feature network can be downloaded here, so on our embedded models the features
come from the classifier we train ourselves (:mod:`relaxspec.evaluation.classifier`):

* :func:`classifier_frechet_distance`, the **FID-like distance**: the Fréchet distance
  (:func:`frechet_distance`, the FID formula) between Gaussians fitted to *our classifier's*
  penultimate-layer features. It is **not comparable to Inception FID** -- not in scale, not in
  meaning, not across classifiers: compare numbers only when they come from the same classifier
  checkpoint, the same reference images and the same sample count (the estimate is biased
  upward for small samples, as FID is).
* :func:`precision_recall`: Kynkäänniemi et al. 2019 (k-NN manifolds), on the same features.
* :func:`class_accuracy`: the share of generated images the classifier assigns to the class they
  were conditioned on (top-1, or top-k).
* :func:`bootstrap_ci`: a percentile-bootstrap confidence interval for any of them, resampling
  images.

Features may be numpy arrays or torch tensors ``[n, dim]``; all statistics are computed in
float64.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from relaxspec.errors import RelaxspecError

#: Offset added to both covariance diagonals when the product's square root is not finite
#: (singular covariances, e.g. fewer samples than dimensions), as pytorch-fid and clean-fid do.
FID_EPS = 1e-6
#: Largest imaginary part of the square root's diagonal tolerated as rounding (pytorch-fid's).
IMAGINARY_TOLERANCE = 1e-3


def _as_float64(feats, name: str) -> np.ndarray:
    array = feats.detach().cpu().numpy() if isinstance(feats, torch.Tensor) else np.asarray(feats)
    if array.ndim != 2:
        raise RelaxspecError(f"{name} must be features [n, dim], got shape {array.shape}")
    array = array.astype(np.float64, copy=False)
    if not np.isfinite(array).all():
        raise RelaxspecError(f"{name} holds non-finite values")
    return array


def feature_statistics(feats) -> tuple[np.ndarray, np.ndarray]:
    """``feats [n, dim]`` -> mean ``[dim]`` and unbiased covariance ``[dim, dim]`` (float64)."""
    array = _as_float64(feats, "features")
    if array.shape[0] < 2:
        raise RelaxspecError(f"a covariance needs at least 2 samples, got {array.shape[0]}")
    return array.mean(axis=0), np.cov(array, rowvar=False).reshape(array.shape[1], array.shape[1])


def _sqrtm(matrix: np.ndarray) -> np.ndarray:
    from scipy import linalg

    with warnings.catch_warnings():  # scipy warns on ill-conditioned input; the caller checks the result
        warnings.simplefilter("ignore")
        return linalg.sqrtm(matrix)


def frechet_distance_from_statistics(mu_a: np.ndarray, sigma_a: np.ndarray, mu_b: np.ndarray, sigma_b: np.ndarray,
                                     eps: float = FID_EPS) -> float:
    """Fréchet distance between N(mu_a, sigma_a) and N(mu_b, sigma_b) (Heusel et al. 2017, eq. 6):

        ||mu_a - mu_b||^2 + Tr(sigma_a + sigma_b - 2 (sigma_a sigma_b)^(1/2))

    computed as pytorch-fid / clean-fid do: ``scipy.linalg.sqrtm`` of the product; if it is not
    finite (singular covariances), again with ``eps * I`` added to both; an imaginary part from
    rounding is dropped, a large one (the product is far from PSD) raises. Never negative.
    """
    mu_a, mu_b = np.atleast_1d(np.asarray(mu_a, np.float64)), np.atleast_1d(np.asarray(mu_b, np.float64))
    sigma_a, sigma_b = np.atleast_2d(np.asarray(sigma_a, np.float64)), np.atleast_2d(np.asarray(sigma_b, np.float64))
    if mu_a.shape != mu_b.shape or sigma_a.shape != sigma_b.shape or sigma_a.shape != (mu_a.size, mu_a.size):
        raise RelaxspecError(f"mismatched statistics: means {mu_a.shape} / {mu_b.shape}, "
                             f"covariances {sigma_a.shape} / {sigma_b.shape}")
    diff = mu_a - mu_b
    covmean = _sqrtm(sigma_a @ sigma_b)
    if not np.isfinite(covmean).all() or (
            np.iscomplexobj(covmean) and np.abs(np.diagonal(covmean).imag).max() > IMAGINARY_TOLERANCE):
        offset = np.eye(sigma_a.shape[0]) * eps
        covmean = _sqrtm((sigma_a + offset) @ (sigma_b + offset))
    if not np.isfinite(covmean).all():
        raise RelaxspecError("the Fréchet distance is not finite: the feature covariances are degenerate")
    if np.iscomplexobj(covmean):
        largest = np.abs(np.diagonal(covmean).imag).max()
        if largest > IMAGINARY_TOLERANCE:
            raise RelaxspecError(f"the covariance product has no real square root (imaginary part {largest:.3g})")
        covmean = covmean.real
    distance = diff @ diff + np.trace(sigma_a) + np.trace(sigma_b) - 2.0 * np.trace(covmean)
    return max(float(distance), 0.0)  # rounding can leave -1e-12 for identical statistics


def frechet_distance(feats_a, feats_b, eps: float = FID_EPS) -> float:
    """The FID formula on two feature sets ``[n_a, dim]`` and ``[n_b, dim]`` (Gaussian fit to each).

    With Inception pool3 features this is FID; with :class:`ImageClassifier` features it is our
    FID-like distance (see the module docstring: not comparable to Inception FID)."""
    mu_a, sigma_a = feature_statistics(feats_a)
    mu_b, sigma_b = feature_statistics(feats_b)
    if mu_a.shape != mu_b.shape:
        raise RelaxspecError(f"feature sizes differ: {mu_a.shape[0]} vs {mu_b.shape[0]}")
    return frechet_distance_from_statistics(mu_a, sigma_a, mu_b, sigma_b, eps)


def frechet_distance_to(reference_feats) -> Callable[[np.ndarray], float]:
    """A function ``feats -> Fréchet distance to reference_feats``, fast for repeated calls
    against one reference set (the real images), as in a bootstrap over generated images.

    It uses Tr (S_a S_b)^(1/2) = Tr (R S_b R)^(1/2) with R = S_a^(1/2) computed once: the matrices
    share their eigenvalues, and R S_b R is symmetric PSD, so the trace is the sum of the square
    roots of its (clipped at 0) ``eigvalsh``. Equal to :func:`frechet_distance` up to rounding,
    also for singular covariances, where the Schur ``sqrtm`` is both slow and fragile.
    """
    mu_a, sigma_a = feature_statistics(reference_feats)
    values, vectors = np.linalg.eigh(sigma_a)
    root_a = (vectors * np.sqrt(np.clip(values, 0.0, None))) @ vectors.T
    trace_a = np.trace(sigma_a)

    def distance(feats) -> float:
        mu_b, sigma_b = feature_statistics(feats)
        if mu_b.shape != mu_a.shape:
            raise RelaxspecError(f"feature sizes differ: {mu_a.shape[0]} vs {mu_b.shape[0]}")
        inner = root_a @ sigma_b @ root_a
        trace_covmean = np.sqrt(np.clip(np.linalg.eigvalsh((inner + inner.T) / 2), 0.0, None)).sum()
        diff = mu_a - mu_b
        return max(float(diff @ diff + trace_a + np.trace(sigma_b) - 2.0 * trace_covmean), 0.0)

    return distance


def classifier_frechet_distance(classifier, real_images, fake_images, batch_size: int = 512) -> float:
    """The **FID-like distance**: :func:`frechet_distance` between ``classifier.features`` of real
    and generated images (uint8 ``[n, H, W, 3]`` or float ``[n, 3, H, W]`` in [-1, 1]).

    NOT comparable to Inception FID (other features, other scale); comparable only between runs
    that use the same classifier checkpoint, reference set and sample count."""
    return frechet_distance(classifier.features(real_images, batch_size), classifier.features(fake_images, batch_size))


# ------------------------------------------------------------------------------------------
# Precision and recall (Kynkäänniemi et al. 2019)
# ------------------------------------------------------------------------------------------


def _pairwise_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Euclidean distances ``[len(a), len(b)]`` (float64, so the matmul form loses nothing that matters)."""
    squared = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * a @ b.T
    return squared.clamp_min_(0.0).sqrt_()


def knn_radii(feats: torch.Tensor, k: int, chunk: int = 2048) -> torch.Tensor:
    """Distance from each row of ``feats [n, dim]`` to its k-th nearest *other* row ``[n]``."""
    n = feats.shape[0]
    if not 1 <= k < n:
        raise RelaxspecError(f"k-NN radii need 1 <= k < number of samples, got k={k} with {n} samples")
    radii = []
    for start in range(0, n, chunk):
        dist = _pairwise_distances(feats[start : start + chunk], feats)
        # the k+1 smallest include the point itself (distance 0)
        radii.append(dist.topk(k + 1, dim=1, largest=False).values[:, k])
    return torch.cat(radii)


def manifold_coverage(manifold: torch.Tensor, radii: torch.Tensor, queries: torch.Tensor, chunk: int = 2048) -> float:
    """Share of ``queries`` inside the union of balls ``B(manifold_i, radii_i)``."""
    inside = []
    for start in range(0, queries.shape[0], chunk):
        dist = _pairwise_distances(queries[start : start + chunk], manifold)
        inside.append((dist <= radii[None, :]).any(dim=1))
    return float(torch.cat(inside).double().mean())


def precision_recall(real_feats, fake_feats, k: int = 3, chunk: int = 2048) -> tuple[float, float]:
    """Improved precision and recall (Kynkäänniemi et al. 2019, k = 3 as the papers use).

    Each set approximates its manifold by balls around every sample reaching its k-th nearest
    neighbour in the same set. Precision = share of generated samples inside the real manifold
    (fidelity); recall = share of real samples inside the generated manifold (coverage).
    Distances are computed ``chunk`` rows at a time (memory ``chunk x n``).
    """
    real = torch.from_numpy(_as_float64(real_feats, "real features"))
    fake = torch.from_numpy(_as_float64(fake_feats, "fake features"))
    if real.shape[1] != fake.shape[1]:
        raise RelaxspecError(f"feature sizes differ: {real.shape[1]} vs {fake.shape[1]}")
    precision = manifold_coverage(real, knn_radii(real, k, chunk), fake, chunk)
    recall = manifold_coverage(fake, knn_radii(fake, k, chunk), real, chunk)
    return precision, recall


# ------------------------------------------------------------------------------------------
# Class accuracy
# ------------------------------------------------------------------------------------------


def topk_hits(logits, labels, k: int = 1) -> np.ndarray:
    """bool ``[n]``: whether ``labels[i]`` is among the ``k`` largest ``logits[i]``."""
    logits, labels = torch.as_tensor(logits), torch.as_tensor(labels).reshape(-1)
    if logits.ndim != 2 or logits.shape[0] != labels.shape[0]:
        raise RelaxspecError(f"logits must be [n, classes] with n = {labels.shape[0]} labels, got {tuple(logits.shape)}")
    ranked = logits.topk(min(k, logits.shape[1]), dim=1).indices
    return (ranked == labels[:, None].to(ranked.device)).any(dim=1).cpu().numpy()


def class_accuracy(classifier, images, labels, k: int = 1, batch_size: int = 512) -> float:
    """Share of ``images`` whose class ``labels[i]`` (the condition they were generated for, or
    the true class of real images) is in the classifier's top ``k``."""
    return float(topk_hits(classifier.logits(images, batch_size), labels, k).mean())


# ------------------------------------------------------------------------------------------
# Bootstrap
# ------------------------------------------------------------------------------------------


def bootstrap_ci(metric_fn: Callable[..., float], *arrays, n_boot: int = 200, alpha: float = 0.05, seed: int = 0,
                 paired: bool = True, bias_correct: bool = False) -> tuple[float, float, float]:
    """``(value, lo, hi)``: ``metric_fn(*arrays)`` and its percentile-bootstrap ``1 - alpha``
    interval, from ``n_boot`` resamplings of the images (rows) with replacement.

    ``paired=True``: all arrays are rows of the same images (features and labels, or one array of
    per-image hits) and share one index draw. ``paired=False``: the arrays are independent samples
    (real vs generated features, for :func:`frechet_distance`), each resampled on its own.

    ``bias_correct``: shift the interval by the bootstrap estimate of the bias (mean of the
    draws minus ``value``; Efron & Tibshirani 1993, ch. 10), so it describes the spread of the
    estimate around ``value``. Needed for the Fréchet distance: a resample repeats images, which
    acts like a smaller sample, and the Fréchet distance grows as samples shrink, so plain
    percentile intervals can lie entirely above ``value``.

    Resampling duplicates images, which shrinks k-NN radii: intervals for
    :func:`precision_recall` are only indicative.
    """
    if not arrays:
        raise RelaxspecError("bootstrap_ci needs at least one array to resample")
    if n_boot < 1 or not 0 < alpha < 1:
        raise RelaxspecError(f"bootstrap_ci needs n_boot >= 1 and alpha in (0, 1), got {n_boot}, {alpha}")
    lengths = [len(a) for a in arrays]
    if paired and len(set(lengths)) > 1:
        raise RelaxspecError(f"paired resampling needs arrays of one length, got {lengths}; "
                             "pass paired=False for independent samples")
    if min(lengths) < 1:
        raise RelaxspecError("bootstrap_ci cannot resample an empty array")
    rng = np.random.default_rng(seed)
    value = float(metric_fn(*arrays))
    draws = np.empty(n_boot)
    for b in range(n_boot):
        if paired:
            index = rng.integers(0, lengths[0], lengths[0])
            resampled = [a[index] for a in arrays]
        else:
            resampled = [a[rng.integers(0, n, n)] for a, n in zip(arrays, lengths, strict=True)]
        draws[b] = metric_fn(*resampled)
    lo, hi = np.quantile(draws, [alpha / 2, 1 - alpha / 2])
    if bias_correct:
        bias = draws.mean() - value
        lo, hi = lo - bias, hi - bias
    return value, float(lo), float(hi)


# ------------------------------------------------------------------------------------------
# Everything at once
# ------------------------------------------------------------------------------------------


FEATURE_NETWORK = "relaxspec classifier (NOT Inception: the FID-like distance is not comparable to FID)"


def _unit_interval(interval: tuple[float, float, float]) -> tuple[float, float, float]:
    value, lo, hi = interval
    return value, min(max(lo, 0.0), 1.0), min(max(hi, 0.0), 1.0)


@dataclass
class Measured:
    """One set of generated images measured against a :class:`QualityReference`: the ``report``
    (see :meth:`QualityReference.measure`) and the per-image ``features`` and top-1 ``hits`` that
    paired comparisons between sets resample."""

    report: dict
    features: np.ndarray
    hits: np.ndarray | None


class QualityReference:
    """Held-out real images on ``classifier``'s features, computed once for any number of
    generated sets: their features, k-NN radii and the Fréchet distance to them (whose square
    root is taken once, so each bootstrap resample costs one symmetric eigendecomposition)."""

    def __init__(self, classifier, real_images, *, k: int = 3, batch_size: int = 512) -> None:
        self.classifier, self.k, self.batch_size = classifier, k, batch_size
        self.real = classifier.features(real_images, batch_size).double()
        self.fid = frechet_distance_to(self.real.numpy())
        self.radii = knn_radii(self.real, k) if len(self.real) > k else None

    def precision(self, feats: np.ndarray) -> float:
        return manifold_coverage(self.real, self.radii, torch.from_numpy(feats))

    def recall(self, feats: np.ndarray) -> float:
        feats_t = torch.from_numpy(feats)
        return manifold_coverage(feats_t, knn_radii(feats_t, self.k), self.real)

    def measure(self, images, labels=None, *, n_boot: int = 200, alpha: float = 0.05, seed: int = 0) -> Measured:
        """The quality table of generated ``images`` (uint8 ``[n, H, W, 3]``) conditioned on
        ``labels`` ``[n]`` (optional). Report keys: ``fid_like`` ``(value, lo, hi)`` (None below
        2 images), ``precision`` / ``recall`` point values with ``precision_interval`` /
        ``recall_interval`` ``(value, lo, hi)`` (None when either set has at most ``k``
        images), ``class_accuracy`` / ``top5_accuracy`` ``(value, lo, hi)`` and
        ``class_accuracy_by_class`` ``{class: [hits, images]}`` (None without labels), ``n_real``,
        ``n_fake``, ``feature_network``.

        Intervals are percentile bootstraps over the *generated* images (``n_boot`` draws; the
        real images are the fixed reference, as FID's precomputed statistics are). The set-level
        metrics are biased under resampling with repeats (duplicates shrink k-NN radii and grow
        the Fréchet distance), so their intervals are shifted by the bootstrap bias
        (:func:`bootstrap_ci`), and precision / recall intervals are clipped to [0, 1]. With
        ``n_boot = 0`` every interval is ``(value, None, None)``."""
        feats = self.classifier.features(images, self.batch_size).double().numpy()

        def interval(fn, *arrays, bias_correct=False):
            if n_boot < 1:
                return float(fn(*arrays)), None, None
            return bootstrap_ci(fn, *arrays, n_boot=n_boot, alpha=alpha, seed=seed, bias_correct=bias_correct)

        report = {"feature_network": FEATURE_NETWORK, "n_real": len(self.real), "n_fake": len(feats),
                  "fid_like": interval(self.fid, feats, bias_correct=True) if len(feats) >= 2 else None,
                  "precision": None, "recall": None, "precision_interval": None, "recall_interval": None,
                  "class_accuracy": None, "top5_accuracy": None, "class_accuracy_by_class": None}
        if self.radii is not None and len(feats) > self.k:
            for name, fn in (("precision", self.precision), ("recall", self.recall)):
                measured = interval(fn, feats, bias_correct=True)
                report[name] = measured[0]
                report[f"{name}_interval"] = measured if measured[1] is None else _unit_interval(measured)
        hits = None
        if labels is not None:
            labels = np.asarray(labels)
            logits = self.classifier.logits(images, self.batch_size)
            hits = topk_hits(logits, labels, 1).astype(np.float64)
            report["class_accuracy"] = interval(np.mean, hits)
            report["top5_accuracy"] = interval(np.mean, topk_hits(logits, labels, 5).astype(np.float64))
            report["class_accuracy_by_class"] = {int(c): [int(hits[labels == c].sum()), int((labels == c).sum())]
                                                 for c in np.unique(labels)}
        return Measured(report, feats, hits)


def quality_report(classifier, real_images, fake_images, fake_labels=None, *, k: int = 3, n_boot: int = 200,
                   alpha: float = 0.05, seed: int = 0, batch_size: int = 512) -> dict:
    """The offline quality table for generated images, on ``classifier``'s features and logits:
    :meth:`QualityReference.measure`'s report (``relaxspec bench`` and ``relaxspec eval`` use the
    same). Compare FID-like values only at equal ``n_fake``. The precision / recall intervals cost
    ``n_boot`` k-NN passes over the generated set; ``n_boot = 0`` skips every interval."""
    reference = QualityReference(classifier, real_images, k=k, batch_size=batch_size)
    return reference.measure(fake_images, fake_labels, n_boot=n_boot, alpha=alpha, seed=seed).report


__all__ = [
    "FID_EPS", "bootstrap_ci", "class_accuracy", "classifier_frechet_distance", "feature_statistics",
    "frechet_distance", "frechet_distance_from_statistics", "frechet_distance_to", "knn_radii", "manifold_coverage", "precision_recall",
    "FEATURE_NETWORK", "Measured", "QualityReference", "quality_report", "topk_hits",
]
