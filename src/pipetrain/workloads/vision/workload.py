"""The `vision` workload: a BasicBlock ResNet (ResNet-18 by default) classifying synthetic images."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from pipetrain.errors import ConfigError
from pipetrain.workloads.registry import DataRequest, Workload
from pipetrain.workloads.vision.images import Images, image_batches, num_image_batches, synthetic_images
from pipetrain.workloads.vision.resnet import RESNET_PRESETS, ResNetModel

__all__ = ["VisionWorkload"]


class VisionWorkload(Workload):
    """Image classification: `ResNetModel` of the preset, cross-entropy, accuracy, on synthetic images (each class a
    pattern under noise) of the preset's size. BatchNorm throughout: `--deferred-batchnorm` applies."""

    name = "vision"
    summary = "ResNet-18 (torchvision's architecture; preset tiny: narrow) on synthetic 3x32x32 images"
    presets = RESNET_PRESETS
    metrics = ("accuracy",)
    data_help = "synthetic images only"

    def model(self, preset: str, *, seq_len: int | None = None) -> ResNetModel:
        self.check_preset(preset)
        self.check_window(seq_len)
        return ResNetModel(RESNET_PRESETS[preset])

    def load_data(self, request: DataRequest) -> tuple[Images, Images]:
        if request.path is not None:
            raise ConfigError(f"the vision workload makes its own images, not {str(request.path)!r}",
                              hint="drop --data (or pass --data synthetic)")
        c = RESNET_PRESETS[request.preset]
        make = lambda n, seed: synthetic_images(n, classes=c.classes, channels=c.channels,  # noqa: E731
                                                size=c.image_size, seed=seed)
        return make(request.train_samples, request.seed), make(request.test_samples, request.seed + 1)

    def batches(self, dataset: Images, batch_size: int, *, shuffle: bool, seed: int, epoch: int, replica: int,
                replicas: int, bucket: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return image_batches(dataset, batch_size, shuffle=shuffle, seed=seed, epoch=epoch, replica=replica,
                             replicas=replicas)

    def num_batches(self, dataset: Images, batch_size: int, *, replicas: int) -> int:
        return num_image_batches(dataset, batch_size)

    def loss(self) -> Callable[..., torch.Tensor]:
        return F.cross_entropy
