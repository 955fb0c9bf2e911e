"""A small ResNet, written the way a user writes their own model: plain PyTorch, no trainer.

`build(spec, **model.kwargs)` is the factory `model.name: "resnet:build"` names. The input
channels come from the data (`spec.feature_shape`, the `image` column after
`digits_png.decode`), the classes from the labels (`spec.num_classes`).
"""

from __future__ import annotations

from torch import Tensor, nn


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection (He et al., 2016)."""

    def __init__(self, channels_in: int, channels_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(nn.Conv2d(channels_in, channels_out, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(channels_out))

    def forward(self, x: Tensor) -> Tensor:
        out = self.bn1(self.conv1(x)).relu()
        return (self.bn2(self.conv2(out)) + self.shortcut(x)).relu()


class ResNet(nn.Module):
    def __init__(self, channels: int, num_classes: int, widths: tuple[int, ...] = (16, 32, 64),
                 blocks_per_stage: int = 1) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, widths[0], 3, padding=1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        stages, width = [], widths[0]
        for i, out in enumerate(widths):
            for j in range(blocks_per_stage):
                stages.append(BasicBlock(width, out, stride=2 if i > 0 and j == 0 else 1))
                width = out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))

    def forward(self, image: Tensor) -> Tensor:
        return self.head(self.stages(self.stem(image)))


def build(spec, widths: list[int] = (16, 32, 64), blocks_per_stage: int = 1) -> ResNet:
    channels = spec.feature_shape[0]
    return ResNet(channels, spec.num_classes, tuple(widths), blocks_per_stage)
