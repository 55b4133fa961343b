"""Offline training data: the Noto emoji set from the npm package ``emoji-datasource-google``, and
the one image-set type, split loader and augmentation every recipe reads it with."""

from relaxspec.data.emoji import (
    ImageSet,
    augment,
    build_emoji_dataset,
    find_package,
    load_classes,
    load_data,
    load_split,
    resolve_classes,
)

__all__ = ["ImageSet", "augment", "build_emoji_dataset", "find_package", "load_classes", "load_data", "load_split",
           "resolve_classes"]
