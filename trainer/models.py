"""The two networks of MXNet's MNIST example, in PyTorch.

``lenet``: conv 5x5x20, tanh, max-pool 2x2, conv 5x5x50, tanh, max-pool 2x2,
fc 500, tanh, fc 10 (431,080 parameters). ``mlp``: fc 128, relu, fc 64, relu,
fc 10 (109,386 parameters). Both end in logits; the softmax is in the loss.
Weights start as MXNet's default initializer draws them (Xavier, gaussian,
``factor_type="in"``, magnitude 2, so a normal with standard deviation
``sqrt(2 / fan_in)``), biases at zero.

LeNet computes exactly the function MXNet's does, a little faster: ``tanh``
and max-pooling commute (tanh is increasing), so it pools first and takes
``tanh`` of a quarter of the values. The outputs are identical; a gradient can
differ only where two pooled inputs tie after ``tanh``, which happens only
where ``tanh`` saturates and its derivative is 0 to float precision. On CPU the
trainer also runs LeNet in channels-last layout (:func:`create_model`), which
oneDNN's convolutions prefer.

``reference_forward`` keeps the plain order of operations for the tests.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

NETWORKS = ("mlp", "lenet")
EXPECTED_PARAMS = {"lenet": 431_080, "mlp": 109_386}


class LeNet(nn.Module):
    """LeNet-5 as in MXNet's ``symbols/lenet.py``."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, kernel_size=5)
        self.conv2 = nn.Conv2d(20, 50, kernel_size=5)
        self.fc1 = nn.Linear(50 * 4 * 4, 500)
        self.fc2 = nn.Linear(500, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(F.max_pool2d(self.conv1(x), 2))
        y = torch.tanh(F.max_pool2d(self.conv2(y), 2))
        y = torch.tanh(self.fc1(y.reshape(y.shape[0], -1)))
        return self.fc2(y)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The operations in MXNet's order (tanh before pooling)."""
        y = F.max_pool2d(torch.tanh(self.conv1(x)), 2)
        y = F.max_pool2d(torch.tanh(self.conv2(y)), 2)
        y = torch.tanh(self.fc1(torch.flatten(y, 1)))
        return self.fc2(y)


class MLP(nn.Module):
    """The multi-layer perceptron of MXNet's ``symbols/mlp.py``."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(28 * 28, 128)
        self.fc2 = nn.Linear(128, 64)
        self.fc3 = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.fc1(x.reshape(x.shape[0], -1)))
        y = F.relu(self.fc2(y))
        return self.fc3(y)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Same as :meth:`forward` (kept for symmetry with LeNet)."""
        return self.forward(x)


def mxnet_init_(model: nn.Module, generator: torch.Generator | None = None) -> nn.Module:
    """Initialise in place as MXNet's default: weights N(0, sqrt(2 / fan_in)), biases 0."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            else:
                fan_in = math.prod(p.shape[1:])
                p.normal_(0.0, math.sqrt(2.0 / fan_in), generator=generator)
    return model


def create_model(network: str, *, seed: int | None = None, channels_last: bool = False) -> nn.Module:
    """A freshly initialised ``lenet`` or ``mlp`` on the CPU.

    Args:
        network: ``"lenet"`` or ``"mlp"``.
        seed: seeds the initial weights (the global generator when None).
        channels_last: put LeNet's convolution weights in channels-last layout.
    """
    if network == "lenet":
        model: nn.Module = LeNet()
    elif network == "mlp":
        model = MLP()
    else:
        raise ValueError(f"unknown network {network!r}; choose from {', '.join(NETWORKS)}")
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    mxnet_init_(model, gen)
    if channels_last and network == "lenet":
        model = model.to(memory_format=torch.channels_last)
    return model


def num_parameters(model: nn.Module) -> int:
    """The number of trainable scalars."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
