"""LeNet and MLP: MXNet's shapes, parameter counts and initialisation; the fast LeNet path is exact."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from trainer import models


@pytest.mark.parametrize(("network", "count"), [("lenet", 431_080), ("mlp", 109_386)])
def test_parameter_counts_match_mxnet(network: str, count: int) -> None:
    model = models.create_model(network)
    assert models.num_parameters(model) == count == models.EXPECTED_PARAMS[network]


def test_layer_shapes() -> None:
    lenet = {k: tuple(v.shape) for k, v in models.create_model("lenet").state_dict().items()}
    assert lenet == {
        "conv1.weight": (20, 1, 5, 5), "conv1.bias": (20,),
        "conv2.weight": (50, 20, 5, 5), "conv2.bias": (50,),
        "fc1.weight": (500, 800), "fc1.bias": (500,),
        "fc2.weight": (10, 500), "fc2.bias": (10,),
    }
    mlp = {k: tuple(v.shape) for k, v in models.create_model("mlp").state_dict().items()}
    assert mlp == {"fc1.weight": (128, 784), "fc1.bias": (128,), "fc2.weight": (64, 128), "fc2.bias": (64,),
                   "fc3.weight": (10, 64), "fc3.bias": (10,)}


@pytest.mark.parametrize("network", models.NETWORKS)
def test_output_is_logits_per_sample(network: str) -> None:
    out = models.create_model(network)(torch.rand(7, 1, 28, 28))
    assert out.shape == (7, 10) and out.dtype == torch.float32


def test_mxnet_default_initialisation() -> None:
    model = models.create_model("lenet", seed=3)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        else:
            expected = math.sqrt(2.0 / math.prod(p.shape[1:]))
            assert abs(p.std().item() / expected - 1) < 0.1, name
            assert abs(p.mean().item()) < 0.1 * expected, name


def test_seeded_initialisation() -> None:
    a = models.create_model("mlp", seed=1).state_dict()
    b = models.create_model("mlp", seed=1).state_dict()
    c = models.create_model("mlp", seed=2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["fc1.weight"], c["fc1.weight"])


def test_unknown_network() -> None:
    with pytest.raises(ValueError, match="unknown network 'resnet'"):
        models.create_model("resnet")


@pytest.mark.parametrize("channels_last", [False, True])
def test_fast_lenet_equals_mxnet_order(channels_last: bool) -> None:
    torch.manual_seed(0)
    model = models.create_model("lenet", seed=5, channels_last=channels_last)
    x = torch.rand(32, 1, 28, 28)
    y = torch.randint(0, 10, (32,))

    def grads(forward) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        out = forward(x)
        F.cross_entropy(out, y, reduction="sum").backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    out_fast, g_fast = grads(model)
    out_ref, g_ref = grads(model.reference_forward)
    assert torch.equal(out_fast, out_ref)
    for (name, _), a, b in zip(model.named_parameters(), g_fast, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=name)
    with torch.no_grad():
        assert torch.equal(model(x), out_ref)


def test_fast_lenet_when_the_input_needs_a_gradient() -> None:
    model = models.create_model("lenet", seed=5)
    x = torch.rand(4, 1, 28, 28, requires_grad=True)
    model(x).sum().backward()
    gx = x.grad.clone()
    x.grad = None
    model.reference_forward(x).sum().backward()
    torch.testing.assert_close(gx, x.grad)
