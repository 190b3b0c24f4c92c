"""Architecture replicas for tracing where an optional model library is missing (no weights, no data).

``resnet_replica`` builds torchvision's ResNet (same modules, shapes and op sequence as
``torchvision.models.resnet{18,34,50,101,152}``), so ResNet steps can be simulated and the convolution
roofline calibrated on machines without torchvision. With torchvision installed, the zoo's own
``um_lab.models.resnet`` is used instead.
"""

from __future__ import annotations

from torch import nn

from um_lab.models import ModelCase, resnet

_LAYERS = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


class _Basic(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int, down: nn.Module | None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = down

    def forward(self, x):
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + idt)


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int, down: nn.Module | None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, width * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(width * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = down

    def forward(self, x):
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += idt
        return self.relu(out)


class _ResNet(nn.Module):
    def __init__(self, depth: int, classes: int) -> None:
        super().__init__()
        block = _Basic if depth < 50 else _Bottleneck
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = 64
        stages = []
        for i, (n, width) in enumerate(zip(_LAYERS[depth], (64, 128, 256, 512), strict=True)):
            stride = 1 if i == 0 else 2
            blocks = []
            for j in range(n):
                s = stride if j == 0 else 1
                down = None
                if j == 0 and (s != 1 or cin != width * block.expansion):
                    down = nn.Sequential(nn.Conv2d(cin, width * block.expansion, 1, s, bias=False),
                                         nn.BatchNorm2d(width * block.expansion))
                blocks.append(block(cin, width, s, down))
                cin = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


def resnet_replica(depth: int = 50, batch_size: int = 128, image_size: int = 224,
                   classes: int = 1000) -> ModelCase:
    """The zoo's ResNet case with torchvision's constructor replaced by a replica (same name and info)."""
    case = resnet(depth, batch_size=batch_size, image_size=image_size, classes=classes)
    case.build_model = lambda: _ResNet(depth, classes)
    return case


def model_case(name: str, **kwargs) -> ModelCase:
    """``um_lab.models.get_model``, falling back to the ResNet replica when torchvision is missing."""
    from um_lab.models import get_model

    if name.startswith("resnet"):
        try:
            import torchvision  # noqa: F401
        except ImportError:
            return resnet_replica(int(name[len("resnet"):]), **kwargs)
    return get_model(name, **kwargs)
