"""ResNet with BasicBlocks (ResNet-18, -34) as a `BlockModel`: torchvision's architecture, cut into its stem, its four
stages and its head.

Written with `torch.nn` alone, layer for layer as `torchvision.models.resnet` builds it (the same submodule names,
strides, padding, bias-free convolutions, the 1x1 downsample of the first block of a stage, and torchvision's
initialisation: Kaiming-normal convolutions with fan-out, BatchNorm weights 1 and biases 0, torch's default for the
classifier), so that a state dict renamed by `torchvision_names` loads into `torchvision.models.resnet18()` and
computes the same outputs (tests/unit/test_resnet.py checks it where torchvision imports). torchvision itself is not
needed: its wheels are built against one torch build each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

__all__ = ["ResNetConfig", "ResNetModel", "BasicBlock", "RESNET_PRESETS", "torchvision_names"]


@dataclass(frozen=True)
class ResNetConfig:
    """`layers`: BasicBlocks per stage ((2, 2, 2, 2) is ResNet-18); `widths`: channels per stage (torchvision:
    64, 128, 256, 512); `classes`: outputs of the head; images are `channels` x `image_size` x `image_size`."""

    layers: tuple[int, int, int, int] = (2, 2, 2, 2)
    widths: tuple[int, int, int, int] = (64, 128, 256, 512)
    classes: int = 10
    channels: int = 3
    image_size: int = 32


#: ResNet-18 itself (torchvision's widths; `cpu`, the default preset of `pipetrain train`, is it too), ResNet-34, and a
#: narrow ResNet-18 for quick runs.
RESNET_PRESETS: dict[str, ResNetConfig] = {
    "cpu": ResNetConfig(),
    "resnet18": ResNetConfig(),
    "resnet34": ResNetConfig(layers=(3, 4, 6, 3)),
    "tiny": ResNetConfig(widths=(8, 16, 32, 64)),
}


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """torchvision's `BasicBlock`: two 3x3 convolutions with BatchNorm, a residual (1x1 downsample when the shape
    changes)."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = _conv3x3(cin, cout, stride)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(cout, cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False),
                                         nn.BatchNorm2d(cout)) if stride != 1 or cin != cout else None)
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Stem(nn.Module):
    """7x7 convolution with stride 2, BatchNorm, ReLU, 3x3 max-pooling with stride 2."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.maxpool(self.relu(self.bn1(self.conv1(x))))


class Head(nn.Module):
    """Global average pooling and the linear classifier."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.avgpool(x), 1))


_Module = TypeVar("_Module", bound=nn.Module)


def _initialised(module: _Module) -> _Module:
    """torchvision's initialisation of a ResNet's convolutions and norms (the classifier keeps torch's default)."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)
    return module


class ResNetModel:
    """The `BlockModel` of a BasicBlock ResNet: block 0 the stem, blocks 1-4 the stages (`layer1` ... `layer4`, each
    an `nn.Sequential` of BasicBlocks), block 5 the head. Input: images `[batch, channels, size, size]`."""

    num_blocks = 6

    def __init__(self, config: ResNetConfig) -> None:
        self.config = config

    def __repr__(self) -> str:
        return f"ResNetModel({self.config!r})"

    def build_block(self, index: int) -> nn.Module:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.num_blocks:
            raise IndexError(f"block index {index!r} is out of range for a model of {self.num_blocks} blocks")
        c = self.config
        if index == 0:
            return _initialised(Stem(c.channels, c.widths[0]))
        if index == self.num_blocks - 1:
            return _initialised(Head(c.widths[-1], c.classes))
        stage = index - 1
        cin = c.widths[max(stage - 1, 0)]
        cout = c.widths[stage]
        stride = 1 if stage == 0 else 2
        blocks = [BasicBlock(cin, cout, stride)] + [BasicBlock(cout, cout) for _ in range(c.layers[stage] - 1)]
        return _initialised(nn.Sequential(*blocks))

    def example_input(self, batch_size: int) -> torch.Tensor:
        c = self.config
        return torch.zeros(batch_size, c.channels, c.image_size, c.image_size)


def torchvision_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict of `build_sequential(ResNetModel(...))` (keys `<block>.<name>`, as `pipetrain export` writes)
    under torchvision's names (`conv1.weight`, `layer1.0.bn1.running_mean`, `fc.bias`, ...)."""
    renamed = {}
    for key, value in state.items():
        block, _, rest = key.partition(".")
        index = int(block)
        renamed[rest if index in (0, ResNetModel.num_blocks - 1) else f"layer{index}.{rest}"] = value
    return renamed
