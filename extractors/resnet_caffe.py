"""ResNet / ResNeXt builder: the MSRA ResNet-101 of the bottom-up-attention model and the ResNeXt of VinVL.

Faithful to ``test.prototxt`` of peteanderson80/bottom-up-attention (docs/extractor.md#backbone): 7x7/2 stem conv,
3x3/2 max-pool with pad 0 in *ceil* mode, bottleneck blocks with the stride on the first 1x1 conv, every conv
bias-free and followed by a frozen BatchNorm + Scale (``y = (x - mean) / sqrt(var + eps) * gamma + beta``).
Module paths reproduce the detectron2 state-dict keys (``backbone.res4.0.conv1.norm.running_mean`` ...).

ResNeXt (Xie et al. 2017; maskrcnn_benchmark ``resnet.py``, detectron2 ``BottleneckBlock``): ``groups`` > 1 on
the 3x3 conv, ``stride_in_1x1=False`` puts the block stride on the 3x3 conv (Caffe2 / fb.torch ResNeXt), and
the stem pool is ``max_pool2d(3, 2, padding=1)`` in floor mode (``stem_pool="pad1"``). maskrcnn_benchmark's
``FrozenBatchNorm2d`` has no eps (``eps=0``); detectron2's uses 1e-5 (docs/recipes.md#vinvl).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FrozenBatchNorm2d(nn.Module):
    """BatchNorm with fixed statistics and affine parameters (Caffe BatchNorm(use_global_stats) + Scale).

    Implements ``y = gamma * (x - mu) / sqrt(sigma^2 + eps) + beta`` as one per-channel scale and shift.
    """

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features) - eps)

    def scale_shift(self) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self.weight * torch.rsqrt(self.running_var + self.eps)
        return scale, self.bias - self.running_mean * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale, shift = self.scale_shift()
        return x * scale.to(x.dtype).view(1, -1, 1, 1) + shift.to(x.dtype).view(1, -1, 1, 1)


class ConvNorm(nn.Module):
    """A bias-free conv followed by :class:`FrozenBatchNorm2d` (detectron2 ``Conv2d(norm=...)`` key layout).

    :meth:`fold` precomputes the BN-folded weight and bias (``W' = W * s``, ``b' = t``) for fast inference;
    the result is mathematically identical to conv followed by the affine BN.
    """

    def __init__(
        self,
        cin: int,
        cout: int,
        kernel: int,
        stride: int = 1,
        padding: int = 0,
        dilation: int = 1,
        eps: float = 1e-5,
        groups: int = 1,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cout, cin // groups, kernel, kernel))
        self.groups = groups
        nn.init.kaiming_normal_(self.weight, mode="fan_out", nonlinearity="relu")
        self.norm = FrozenBatchNorm2d(cout, eps)
        self.stride, self.padding, self.dilation = stride, padding, dilation
        self._folded: tuple[torch.Tensor, torch.Tensor] | None = None

    def fold(self) -> None:
        """Cache the BN-folded conv (call after loading weights; :meth:`unfold` to drop it)."""
        scale, shift = self.norm.scale_shift()
        self._folded = ((self.weight * scale.view(-1, 1, 1, 1)).detach(), shift.detach())

    def unfold(self) -> None:
        self._folded = None

    def _apply(self, fn, recurse=True):  # keep the folded cache on the module's device/dtype
        out = super()._apply(fn, recurse)
        if self._folded is not None:
            self.fold()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._folded is not None:
            w, b = self._folded
            return F.conv2d(x, w.to(x.dtype), b.to(x.dtype), self.stride, self.padding, self.dilation, self.groups)
        y = F.conv2d(x, self.weight.to(x.dtype), None, self.stride, self.padding, self.dilation, self.groups)
        return self.norm(y)


class BasicStem(nn.Module):
    """conv1 7x7/2 pad 3 + BN + ReLU, then max-pool 3x3/2 pad 0 **ceil mode** (Caffe pooling size rule)."""

    def __init__(self, out_channels: int = 64, eps: float = 1e-5, pool: str = "caffe") -> None:
        super().__init__()
        self.conv1 = ConvNorm(3, out_channels, 7, stride=2, padding=3, eps=eps)
        if pool not in ("caffe", "pad1"):
            raise ValueError(f"stem pool must be caffe or pad1, not {pool!r}")
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu_(self.conv1(x))
        if self.pool == "pad1":  # maskrcnn_benchmark / detectron2 stem: MaxPool2d(3, 2, padding=1), floor mode
            return F.max_pool2d(x, kernel_size=3, stride=2, padding=1)
        return F.max_pool2d(x, kernel_size=3, stride=2, padding=0, ceil_mode=True)


class Bottleneck(nn.Module):
    """MSRA / ResNeXt bottleneck: 1x1 -> 3x3 (``groups``, dilation d, pad d) -> 1x1, + shortcut.

    ``out = ReLU(conv3(ReLU(conv2(ReLU(conv1(x))))) + shortcut(x))``, shortcut = projection conv+BN when the
    shape changes (Caffe ``_branch1``), identity otherwise. The block stride sits on the 1x1 conv
    (``stride_in_1x1``, Caffe MSRA) or on the 3x3 conv (ResNeXt); the projection always carries it.
    """

    def __init__(
        self,
        cin: int,
        bottleneck: int,
        cout: int,
        stride: int = 1,
        dilation: int = 1,
        eps: float = 1e-5,
        groups: int = 1,
        stride_in_1x1: bool = True,
    ) -> None:
        super().__init__()
        s1, s3 = (stride, 1) if stride_in_1x1 else (1, stride)
        self.stride_in_1x1 = stride_in_1x1
        self.shortcut = ConvNorm(cin, cout, 1, stride=stride, eps=eps) if (cin != cout or stride != 1) else None
        self.conv1 = ConvNorm(cin, bottleneck, 1, stride=s1, eps=eps)
        self.conv2 = ConvNorm(
            bottleneck, bottleneck, 3, stride=s3, padding=dilation, dilation=dilation, eps=eps, groups=groups
        )
        self.conv3 = ConvNorm(bottleneck, cout, 1, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.shortcut(x) if self.shortcut is not None else x
        y = F.relu_(self.conv1(x))
        y = F.relu_(self.conv2(y))
        y = self.conv3(y)
        return F.relu_(y + identity)


def make_stage(
    num_blocks: int,
    cin: int,
    bottleneck: int,
    cout: int,
    first_stride: int,
    dilation: int = 1,
    eps: float = 1e-5,
    groups: int = 1,
    stride_in_1x1: bool = True,
) -> nn.Sequential:
    """``num_blocks`` bottlenecks; only the first one strides (and projects)."""
    blocks = []
    for i in range(num_blocks):
        blocks.append(
            Bottleneck(
                cin if i == 0 else cout,
                bottleneck,
                cout,
                stride=first_stride if i == 0 else 1,
                dilation=dilation,
                eps=eps,
                groups=groups,
                stride_in_1x1=stride_in_1x1,
            )
        )
    return nn.Sequential(*blocks)


def make_res5(spec, in_channels: int, groups: int = 1, stride_in_1x1: bool = True) -> tuple[nn.Sequential, int]:
    """The res5 RoI head of a C4 detector (``spec``: an :class:`extractors.spec.BottomUpSpec`) and its output width:
    ``spec.res5_blocks`` bottlenecks of width ``res2_bottleneck * 2**len(stage_blocks)``; the first strides 2, or 1
    when res5 is dilated (Caffe test.prototxt ``res5*_branch2b``: dilation = pad = 2, a 14x14 RoI stays 14x14).
    ``groups``/``stride_in_1x1`` as the backbone the head sits on (ResNeXt: the spec's; Caffe R-101: 1, True)."""
    bottleneck = spec.res2_bottleneck * 2 ** len(spec.stage_blocks)
    out = bottleneck * spec.expansion
    first_stride = 1 if spec.res5_dilation > 1 else 2
    return make_stage(
        spec.res5_blocks,
        in_channels,
        bottleneck,
        out,
        first_stride,
        spec.res5_dilation,
        spec.bn_eps,
        groups=groups,
        stride_in_1x1=stride_in_1x1,
    ), out


class ResNetC4(nn.Module):
    """Stem + stages res2..res{k+1} (``stage_blocks`` = blocks per stage; R-101: 3, 4, 23 -> res4 at stride 16)."""

    def __init__(
        self,
        stage_blocks: tuple[int, ...],
        stem_channels: int = 64,
        res2_bottleneck: int = 64,
        expansion: int = 4,
        eps: float = 1e-5,
        groups: int = 1,
        stride_in_1x1: bool = True,
        stem_pool: str = "caffe",
    ) -> None:
        super().__init__()
        self.stem = BasicStem(stem_channels, eps, stem_pool)
        self.stage_names: list[str] = []
        cin, width = stem_channels, res2_bottleneck
        for i, n in enumerate(stage_blocks):
            name = f"res{i + 2}"
            cout = width * expansion
            self.add_module(
                name,
                make_stage(
                    n,
                    cin,
                    width,
                    cout,
                    first_stride=1 if i == 0 else 2,
                    eps=eps,
                    groups=groups,
                    stride_in_1x1=stride_in_1x1,
                ),
            )
            self.stage_names.append(name)
            cin, width = cout, width * 2
        self.out_channels = cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for name in self.stage_names:
            x = getattr(self, name)(x)
        return x


def fold_all(module: nn.Module) -> None:
    """Fold every frozen BN into its conv (inference speed; same outputs up to rounding)."""
    for m in module.modules():
        if isinstance(m, ConvNorm):
            m.fold()
