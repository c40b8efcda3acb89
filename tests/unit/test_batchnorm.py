"""BatchNorm under pipelining, in one process: deferred statistics equal the whole batch's, a recomputed forward moves
no statistics, the shape run accepts BatchNorm, and the ResNet blocks are torchvision's ResNet-18."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipetrain.batchnorm import StageNorms
from pipetrain.blocks import build_sequential
from pipetrain.errors import ConfigError
from pipetrain.pipeline.shapes import boundary_tensors, check_model_outputs, meta_blocks
from pipetrain.workloads.vision.resnet import ResNetConfig, ResNetModel, torchvision_names


def _stats(norm: nn.Module) -> list[torch.Tensor]:
    return [norm.running_mean, norm.running_var, norm.num_batches_tracked]


@pytest.mark.parametrize("momentum", [0.1, None])
def test_deferred_statistics_equal_the_whole_batch(momentum):
    torch.manual_seed(0)
    whole, deferred = nn.BatchNorm2d(5, momentum=momentum), nn.BatchNorm2d(5, momentum=momentum)
    norms = StageNorms(deferred, deferred=True)
    for _ in range(3):  # three steps of 4 micro-batches of 3 images
        x = 2 + 3 * torch.randn(12, 5, 4, 4)
        whole(x)
        before = [t.clone() for t in _stats(deferred)]
        parts = [deferred(part) for part in x.chunk(4)]
        assert all(torch.equal(t, u) for t, u in zip(_stats(deferred), before))  # nothing moves before the commit
        norms.commit()
        for part, out in zip(x.chunk(4), parts):  # each micro-batch normalised by its own statistics
            torch.testing.assert_close(out, nn.functional.batch_norm(part, None, None, training=True))
        for got, want in zip(_stats(deferred), _stats(whole)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    deferred.eval()  # eval mode normalises by the running statistics, deferred or not
    x = torch.randn(2, 5, 4, 4)
    torch.testing.assert_close(deferred(x), whole.eval()(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("deferred", [False, True])
def test_a_recomputed_forward_moves_no_statistics(deferred):
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU())
    plain, recomputed = block, copy.deepcopy(block)
    norms = StageNorms(recomputed, deferred=deferred)
    x = torch.randn(8, 4)
    plain(x).sum().backward()
    out = checkpoint(recomputed, x, use_reentrant=False, context_fn=lambda: (nullcontext(), norms.recomputing()))
    out.sum().backward()  # the forward runs again here
    norms.commit()
    for got, want in zip(_stats(recomputed[1]), _stats(plain[1])):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(recomputed[0].weight.grad, plain[0].weight.grad)


class _NormModel:
    num_blocks = 3

    def build_block(self, index: int) -> nn.Module:
        return [nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU()), nn.Linear(4, 2)][index]

    def example_input(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, 3)


def test_shape_runs_take_batchnorm():
    blocks = meta_blocks(_NormModel())
    check_model_outputs(blocks, [(0, 2), (2, 3)], torch.zeros(1, 3))  # one sample: in eval mode, as evaluate runs
    train = boundary_tensors(blocks, [(0, 2), (2, 3)], torch.zeros(4, 3), train=True)  # a micro-batch's own size
    assert [t.shape for t in train[1]] == [torch.Size([4, 4])] and train[1][0].requires_grad
    with pytest.raises(ConfigError, match=r"block 1 \(Sequential\) cannot train on a micro-batch of 1 sample"):
        boundary_tensors(blocks, [(0, 2), (2, 3)], torch.zeros(1, 3), train=True)


def test_resnet18_has_torchvision_s_parameters_and_names():
    model = ResNetModel(ResNetConfig(classes=1000, image_size=224))
    net = build_sequential(model, seed=0)
    assert sum(p.numel() for p in net.parameters()) == 11_689_512  # torchvision.models.resnet18()'s count
    names = torchvision_names(net.state_dict())
    assert {"conv1.weight", "bn1.running_var", "layer4.1.bn2.num_batches_tracked", "layer2.0.downsample.1.weight",
            "fc.bias"} <= set(names)
    assert len(names) == 122  # 62 parameters and 60 buffers, as torchvision's state dict holds
    assert net(model.example_input(2)).shape == (2, 1000)


def test_resnet18_equals_torchvision_s():
    try:  # a wheel built against another torch raises RuntimeError ("operator torchvision::nms does not exist")
        import torchvision
    except Exception as err:
        pytest.skip(f"torchvision does not import beside this torch: {type(err).__name__}: {err}")
    reference = torchvision.models.resnet18(num_classes=10).eval()
    net = build_sequential(ResNetModel(ResNetConfig()), seed=0).eval()
    assert set(torchvision_names(net.state_dict())) == set(reference.state_dict())
    reference.load_state_dict(torchvision_names(net.state_dict()))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(net(x), reference(x))


def test_deferred_statistics_are_refused_with_compile():
    from pipetrain.config import PipelineConfig

    assert PipelineConfig(pp=2, n_microbatches=4, deferred_batchnorm=True).deferred_batchnorm
    with pytest.raises(ConfigError, match="--deferred-batchnorm with --compile") as err:
        PipelineConfig(pp=2, n_microbatches=4, deferred_batchnorm=True, compile=True)
    assert "drop --compile" in err.value.hint
