"""Vision: ResNet as a `BlockModel` (torchvision's architecture written with `torch.nn`), synthetic images, the
`vision` workload. Full of BatchNorm: see docs/batchnorm.md."""
