"""FedNN's LeNet (Kang et al., 2024, Pattern Recognition, section 4; public code ``myeongkyunkang/FedNN``).

FedNN uses "LeNet [31]" for CIFAR10-C and Digit at 3 x 32 x 32 and "place[s]
BN and GN after each convolution layer"; with FedNN, "WN [on] all
convolutional layers with subsequent AGN".  The paper gives no widths.  The
authors' code (``Models.py``, ``client_model('LeNet*')``) is not the classic
LeNet-5 (6/16 channels, 120/84 units) but the wider CIFAR LeNet of FedDyn and
FedDC, which FedNN follows; that is what this module builds::

    conv1 5x5 in->64 (no padding)  bn1 ReLU maxpool 2     32 -> 28 -> 14
    conv2 5x5 64->64               bn2 ReLU maxpool 2     14 -> 10 -> 5
    flatten 64*5*5 = 1600
    fc1 1600->384 ReLU
    fc2 384->192  ReLU
    fc3 192->num_classes                                   (= ``classifier``)

* Norm after the two convs only (``bn1``, ``bn2``: ``make_norm(norm, 64)``),
  none after the linear layers, as the code.  ``norm="none"`` is FedNN's
  plain ``LeNet`` (no norm layers).
* FedNN's GN baseline uses GroupNorm with **2 groups** (``nn.GroupNorm(2,
  64)``, following FedDyn).  The package's ``gn`` kind is FedWon's rule (32
  groups for 64 channels); FedNN's 2-group GN is not a ``norm`` kind here.
  FedNN's own method (``norm="agn", conv="wn"``) uses AGN with 2 groups, as
  :class:`~mpifl.models.fednn.AdaptiveGroupNorm` does.
* Attribute names and state-dict order are the code's (``conv1``, ``conv2``,
  ``fc1``..``fc3``, then ``bn1``, ``bn2``), so its checkpoints load by name.
  Weights keep torch's default init, as the code.
* Input: exactly 32 x 32 (fc1 is sized for the 5 x 5 map); any channel
  count (``in_channels``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from mpifl.errors import MpiflError
from mpifl.models.checks import check_kinds
from mpifl.models.norm import make_conv, make_norm

IMAGE_SIZE = (32, 32)


class LeNet(nn.Module):
    """FedNN's LeNet (conv 64-64 5x5, fc 1600-384-192); see the module docstring."""

    def __init__(
        self, num_classes: int, in_channels: int = 3, norm: str = "bn", conv: str = "plain"
    ):
        super().__init__()
        self.conv1 = make_conv(conv, in_channels, 64, 5)
        self.conv2 = make_conv(conv, 64, 64, 5)
        self.pool = nn.MaxPool2d(kernel_size=2, stride=2)
        self.fc1 = nn.Linear(64 * 5 * 5, 384)
        self.fc2 = nn.Linear(384, 192)
        self.fc3 = nn.Linear(192, num_classes)
        self.bn1 = make_norm(norm, 64)
        self.bn2 = make_norm(norm, 64)

    @property
    def classifier(self) -> nn.Linear:
        """The final linear layer: the same module as ``fc3`` (read-only alias)."""
        return self.fc3

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Features before the classifier, shape (B, 192)."""
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.relu(self.fc2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encode(x))


def build_lenet(
    *, num_classes: int, in_channels: int, image_size: tuple[int, int], norm: str,
    conv: str = "plain",
) -> LeNet:
    """Registry builder: checks the 32 x 32 input fc1 is sized for."""
    check_kinds(norm, conv)
    if tuple(image_size) != IMAGE_SIZE:
        h, w = image_size
        raise MpiflError(
            f"model lenet needs 32x32 inputs but the data is {h}x{w}; prepare the dataset "
            f"at 32 px (python -m mpifl.data prepare NAME --size 32), or use resnet20 or "
            f"smallcnn, which take other sizes"
        )
    return LeNet(num_classes, in_channels, norm, conv)
