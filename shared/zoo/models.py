"""Small, CPU-fast members of the paper's workload families, each with a width/depth knob.

A model name is a family, optionally with knobs: ``resnet``, ``resnet-w16``,
``transformer-w64-d4`` (``-w`` width, ``-d`` depth; defaults in :data:`DEFAULTS`). A
family builds for the kind of input its dataset has (:data:`SUPPORTS`):

* ``resnet`` -- images: a 3x3 conv stem, ``depth`` residual blocks at ``width`` channels,
  one stride-2 residual block to ``2*width``, global average pool, linear head. Tabular
  data: the same residual structure with linear layers (a residual MLP).
* ``transformer`` -- tokens: a causal pre-norm encoder (``depth`` layers, 2 heads,
  feed-forward ``2*width``) language model. Images: each pixel row is one token, mean
  pooled, for classification.
* ``lstm`` -- tokens: an LSTM language model (``depth`` layers). Images: rows as a
  sequence, last hidden state classified.
* ``autoencoder`` -- ratings: an AutoRec-style user autoencoder, ``depth`` sigmoid layers
  of ``width`` each way.

Guarantees: no dropout and no running statistics (GroupNorm / LayerNorm only), so a
step is a deterministic function of weights, optimizer state and batch, and every piece
of state is a parameter (what a checkpoint must carry, and what consolidation averages).
Building with the same name, dataset and seed gives identical weights, and does not
touch the caller's global RNG state.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from shared.zoo.datasets import DatasetInfo

__all__ = ["ModelName", "MODELS", "DEFAULTS", "SUPPORTS", "parse_model_name", "build_model"]

DEFAULTS: dict[str, tuple[int, int]] = {   # family -> (width, depth)
    "autoencoder": (32, 1),
    "lstm": (32, 1),
    "resnet": (8, 1),
    "transformer": (32, 2),
}
SUPPORTS: dict[str, tuple[str, ...]] = {   # family -> input kinds it can train on
    "autoencoder": ("ratings",),
    "lstm": ("tokens", "image"),
    "resnet": ("image", "tabular"),
    "transformer": ("tokens", "image"),
}
MODELS: tuple[str, ...] = tuple(sorted(DEFAULTS))
MAX_WIDTH, MAX_DEPTH = 1024, 16
TRANSFORMER_HEADS = 2

_NAME_RE = re.compile(r"^(?P<family>[a-z]+)(?:-w(?P<width>\d{1,4}))?(?:-d(?P<depth>\d{1,2}))?$")


@dataclass(frozen=True, kw_only=True)
class ModelName:
    family: str
    width: int
    depth: int


def parse_model_name(name: str) -> ModelName:
    """Family and knobs of ``name``; ValueError names the valid families and the syntax."""
    match = _NAME_RE.match(name)
    family = match.group("family") if match else name
    if match is None or family not in DEFAULTS:
        raise ValueError(f"model: unknown {name!r}; valid: {', '.join(MODELS)} "
                         "(optionally with -w<width> and/or -d<depth>, e.g. resnet-w16-d2)")
    width = int(match.group("width") or DEFAULTS[family][0])
    depth = int(match.group("depth") or DEFAULTS[family][1])
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"model: width of {name!r} must be in 1..{MAX_WIDTH}")
    if not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"model: depth of {name!r} must be in 1..{MAX_DEPTH}")
    if family == "transformer" and width % TRANSFORMER_HEADS:
        raise ValueError(f"model: transformer width must be a multiple of {TRANSFORMER_HEADS}")
    return ModelName(family=family, width=width, depth=depth)


# ---------------------------------------------------------------- ResNet


class _ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(1, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(1, c_out)
        self.skip = (nn.Identity() if stride == 1 and c_in == c_out
                     else nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(self.norm2(self.conv2(out)) + self.skip(x))


class ResNetImage(nn.Module):
    def __init__(self, channels: int, classes: int, width: int, depth: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, width, 3, padding=1, bias=False),
                                  nn.GroupNorm(1, width), nn.ReLU())
        blocks = [_ConvBlock(width, width, 1) for _ in range(depth)]
        blocks.append(_ConvBlock(width, 2 * width, 2))
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))
        return y


class _MlpBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = x + self.fc2(torch.relu(self.fc1(self.norm(x))))
        return y


class ResNetTabular(nn.Module):
    def __init__(self, features: int, outputs: int, width: int, depth: int) -> None:
        super().__init__()
        self.stem = nn.Linear(features, width)
        self.blocks = nn.Sequential(*[_MlpBlock(width) for _ in range(depth)])
        self.head = nn.Linear(width, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.head(torch.relu(self.blocks(self.stem(x))))
        return y


# ---------------------------------------------------------------- sequence models


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] image -> [B, H, C*W] sequence of pixel rows."""
    b, c, h, w = x.shape
    return x.permute(0, 2, 1, 3).reshape(b, h, c * w)


class Transformer(nn.Module):
    def __init__(self, info: DatasetInfo, width: int, depth: int) -> None:
        super().__init__()
        self.lm = info.input_kind == "tokens"
        if self.lm:
            self.embed: nn.Module = nn.Embedding(info.n_outputs, width)
            length = info.input_shape[0]
        else:
            c, h, w = info.input_shape
            self.embed = nn.Linear(c * w, width)
            length = h
        self.position = nn.Parameter(torch.randn(length, width) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, TRANSFORMER_HEADS, 2 * width, dropout=0.0,
                                       batch_first=True, norm_first=True)
            for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, info.n_outputs)
        mask = nn.Transformer.generate_square_subsequent_mask(length) if self.lm else None
        self._mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x if self.lm else _rows(x)) + self.position
        if self._mask is not None and self._mask.device != h.device:
            self._mask = self._mask.to(h.device)
        for layer in self.layers:
            h = layer(h, src_mask=self._mask, is_causal=self.lm)
        h = self.norm(h)
        y: torch.Tensor = self.head(h if self.lm else h.mean(dim=1))
        return y


class Lstm(nn.Module):
    def __init__(self, info: DatasetInfo, width: int, depth: int) -> None:
        super().__init__()
        self.lm = info.input_kind == "tokens"
        if self.lm:
            self.embed: nn.Module = nn.Embedding(info.n_outputs, width)
            features = width
        else:
            c, _, w = info.input_shape
            self.embed = nn.Identity()
            features = c * w
        self.lstm = nn.LSTM(features, width, num_layers=depth, batch_first=True)
        self.head = nn.Linear(width, info.n_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x if self.lm else _rows(x)))
        y: torch.Tensor = self.head(out if self.lm else out[:, -1])
        return y


class AutoEncoder(nn.Module):
    def __init__(self, items: int, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        size = items
        for _ in range(depth):
            layers += [nn.Linear(size, width), nn.Sigmoid()]
            size = width
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.Sigmoid()]
        layers.append(nn.Linear(size, items))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.net(x)
        return y


def check_supported(name: ModelName, info: DatasetInfo) -> None:
    kinds = SUPPORTS[name.family]
    if info.input_kind not in kinds:
        raise ValueError(f"model: {name.family!r} cannot train on dataset {info.name!r} "
                         f"({info.input_kind} input); it takes {' or '.join(kinds)} input")


def build_model(model: str, info: DatasetInfo, *, seed: int) -> nn.Module:
    """A freshly initialised model for ``info``'s data; weights depend only on the arguments."""
    name = parse_model_name(model)
    check_supported(name, info)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name.family == "resnet" and info.input_kind == "image":
            return ResNetImage(info.input_shape[0], info.n_outputs, name.width, name.depth)
        if name.family == "resnet":
            return ResNetTabular(info.input_shape[0], info.n_outputs, name.width, name.depth)
        if name.family == "transformer":
            return Transformer(info, name.width, name.depth)
        if name.family == "lstm":
            return Lstm(info, name.width, name.depth)
        return AutoEncoder(info.n_outputs, name.width, name.depth)
