"""Architecture replicas for tracing where an optional model library is missing (no weights, no data).

``resnet_replica`` builds torchvision's ResNet (same modules, shapes and op sequence as
``torchvision.models.resnet{18,34,50,101,152}``) and ``vit_replica`` its VisionTransformer, so their steps
can be simulated and the roofline calibrated on machines without torchvision. With torchvision
installed, the zoo's own models are used instead.
"""

from __future__ import annotations

import torch
from torch import nn

from um_lab.models import ModelCase, resnet, vit

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


class _EncoderBlock(nn.Module):
    def __init__(self, heads: int, hidden: int, mlp: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(hidden, heads, dropout=0.0, batch_first=True)
        self.dropout = nn.Dropout(0.0)
        self.ln_2 = nn.LayerNorm(hidden, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(hidden, mlp), nn.GELU(), nn.Dropout(0.0), nn.Linear(mlp, hidden),
                                 nn.Dropout(0.0))

    def forward(self, x):
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = self.dropout(y) + x
        return x + self.mlp(self.ln_2(x))


class _Encoder(nn.Module):
    def __init__(self, seq: int, num_layers: int, num_heads: int, hidden_dim: int, mlp_dim: int) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq, hidden_dim).normal_(std=0.02))
        self.dropout = nn.Dropout(0.0)
        self.layers = nn.Sequential(*[_EncoderBlock(num_heads, hidden_dim, mlp_dim) for _ in range(num_layers)])
        self.ln = nn.LayerNorm(hidden_dim, eps=1e-6)

    def forward(self, x):
        return self.ln(self.layers(self.dropout(x + self.pos_embedding)))


class _ViT(nn.Module):
    """torchvision's ``VisionTransformer`` (class token, learned positions, pre-norm encoder, linear head;
    parameters in the same order)."""

    def __init__(self, image_size: int, patch_size: int, num_layers: int, num_heads: int, hidden_dim: int,
                 mlp_dim: int, classes: int) -> None:
        super().__init__()
        self.hidden_dim = hidden_dim
        self.conv_proj = nn.Conv2d(3, hidden_dim, patch_size, patch_size)
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden_dim))
        seq = (image_size // patch_size) ** 2 + 1
        self.encoder = _Encoder(seq, num_layers, num_heads, hidden_dim, mlp_dim)
        self.heads = nn.Sequential(nn.Linear(hidden_dim, classes))

    def forward(self, x):
        n = x.shape[0]
        x = self.conv_proj(x).reshape(n, self.hidden_dim, -1).permute(0, 2, 1)
        x = self.encoder(torch.cat([self.class_token.expand(n, -1, -1), x], dim=1))
        return self.heads(x[:, 0])


def vit_replica(size: str = "b16", batch_size: int = 64, image_size: int = 224, classes: int = 1000,
                **overrides: int) -> ModelCase:
    """The zoo's ViT case with torchvision's constructor replaced by a replica (same name and info)."""
    case = vit(size, batch_size=batch_size, image_size=image_size, classes=classes, **overrides)
    config = {k: case.info[k] for k in ("patch_size", "num_layers", "num_heads", "hidden_dim", "mlp_dim")}
    case.build_model = lambda: _ViT(image_size, classes=classes, **config)
    return case


def model_case(name: str, **kwargs) -> ModelCase:
    """``um_lab.models.get_model``, falling back to the ResNet or ViT replica when torchvision is missing."""
    from um_lab.models import get_model

    if name.startswith("resnet") or name.startswith("vit-"):
        try:
            import torchvision  # noqa: F401
        except ImportError:
            if name.startswith("vit-"):
                return vit_replica(name[len("vit-"):], **kwargs)
            return resnet_replica(int(name[len("resnet"):]), **kwargs)
    return get_model(name, **kwargs)
