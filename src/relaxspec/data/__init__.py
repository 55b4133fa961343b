"""Offline training data: the Noto emoji set from the npm package ``emoji-datasource-google``."""

from relaxspec.data.emoji import (
    build_emoji_dataset,
    find_package,
    load_classes,
    load_split,
    resolve_classes,
)

__all__ = ["build_emoji_dataset", "find_package", "load_classes", "load_split", "resolve_classes"]
