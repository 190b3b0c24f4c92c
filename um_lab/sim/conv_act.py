"""Convolutions on remote activations: probe models, measured vs simulated time per op, and the fit.

Inside a training step whose intermediate results live in host memory, cuDNN's workspace lives there
too (the step allocates it in the activation pool), so a convolution's implicit-GEMM kernels re-read
their transposed operands and the filter's workspace copy over the host link, once per tile
(:func:`um_lab.sim.ops.conv_reads`). ``bench/conv_in_step.py`` measures each convolution of ResNet-50
as a one-convolution model trained through the real backend with activations remote;
:func:`fit_conv_tile` finds the tiles (profile fields ``tile_conv_igemm_kxk`` and ``_1x1``) at which
the simulated op times of each filter kind match the measured ones in geometric mean.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from um_lab.models import ModelCase, custom
from um_lab.policy import Advice, Policy
from um_lab.sim.backend import SimBackend
from um_lab.sim.profile import Profile
from um_lab.types import DataType

#: Intermediate results in host memory, read and written remotely by the GPU (the fit's policy).
ACT_REMOTE = Policy("act-remote", {DataType.ACT: Advice(preferred_location="cpu", accessed_by=frozenset({"gpu"}))},
                    "Intermediate results live in host memory, read and written remotely by the GPU.")
#: Measured op name (PyTorch profiler) -> traced op name (simulator), per direction.
MEASURED_OP = {"fwd": "aten::cudnn_convolution", "bwd": "aten::convolution_backward"}
TRACED_OP = {"fwd": "aten.convolution", "bwd": "aten.convolution_backward"}


class ConvShape(NamedTuple):
    """One convolution: input channels, output channels, input height = width, kernel size, stride."""

    c_in: int
    c_out: int
    size: int
    kernel: int
    stride: int = 1

    @property
    def label(self) -> str:
        """``"64->256 56x56 1x1/1"``."""
        return f"{self.c_in}->{self.c_out} {self.size}x{self.size} {self.kernel}x{self.kernel}/{self.stride}"

    @property
    def kind(self) -> str:
        """``"1x1"`` or ``"kxk"``."""
        return "1x1" if self.kernel == 1 else "kxk"


#: Every distinct convolution of torchvision's ResNet-50 (v1.5: the stride sits on the 3x3).
RESNET50_CONVS: tuple[ConvShape, ...] = (
    ConvShape(3, 64, 224, 7, 2),
    ConvShape(64, 64, 56, 1), ConvShape(64, 64, 56, 3), ConvShape(64, 256, 56, 1), ConvShape(256, 64, 56, 1),
    ConvShape(256, 128, 56, 1), ConvShape(128, 128, 56, 3, 2), ConvShape(128, 512, 28, 1),
    ConvShape(256, 512, 56, 1, 2), ConvShape(512, 128, 28, 1), ConvShape(128, 128, 28, 3),
    ConvShape(512, 256, 28, 1), ConvShape(256, 256, 28, 3, 2), ConvShape(256, 1024, 14, 1),
    ConvShape(512, 1024, 28, 1, 2), ConvShape(1024, 256, 14, 1), ConvShape(256, 256, 14, 3),
    ConvShape(1024, 512, 14, 1), ConvShape(512, 512, 14, 3, 2), ConvShape(512, 2048, 7, 1),
    ConvShape(1024, 2048, 14, 1, 2), ConvShape(2048, 512, 7, 1), ConvShape(512, 512, 7, 3),
)


class ConvProbe(nn.Module):
    """``conv(x * scale)``: the scale makes the conv's input an intermediate result that needs a gradient,
    so the backward computes both the input and the filter gradient, as inside a network."""

    def __init__(self, shape: ConvShape) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.conv = nn.Conv2d(shape.c_in, shape.c_out, shape.kernel, shape.stride, shape.kernel // 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x * self.scale)


def conv_case(shape: ConvShape, batch_size: int = 32) -> ModelCase:
    """A one-convolution model case (loss: mean square of the output), for the real and the sim backend."""
    c, s = shape.c_in, shape.size

    def batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
        return (torch.randn(batch_size, c, s, s, generator=g),)

    return custom(f"conv {shape.label} bs{batch_size}", lambda: ConvProbe(shape), batch,
                  loss_fn=lambda model, x: model(x).square().mean(),
                  info={"shape": shape.label, "batch_size": batch_size})


def _parse_shape(label: str) -> ConvShape:
    chans, size, kern = label.split()
    c_in, c_out = map(int, chans.split("->"))
    k, stride = kern.split("/")
    return ConvShape(c_in, c_out, int(size.split("x")[0]), int(k.split("x")[0]), int(stride))


def conv_samples(rows: Iterable[Mapping[str, Any]], profile: Profile, policy: Policy) -> list[dict[str, Any]]:
    """Per measured row (``bench/conv_in_step.py``) of ``policy`` and direction (fwd, bwd): the measured
    and the simulated GPU time of the op, and simulated / measured."""
    backend = SimBackend(profile)
    out = []
    for r in rows:
        if r.get("policy") != policy.name or r.get("error"):
            continue
        shape = _parse_shape(r["shape"])
        _, sim = backend.op_ms(conv_case(shape, r["batch_size"]), policy)
        for direction in ("fwd", "bwd"):
            measured = r["op_ms"].get(MEASURED_OP[direction])
            simulated = sim.get(TRACED_OP[direction], (0, 0.0))[1]
            if measured and simulated > 0:
                out.append({"shape": r["shape"], "direction": direction, "kind": shape.kind,
                            "measured_ms": measured, "simulated_ms": simulated, "ratio": simulated / measured})
    return out


#: Profile field of each filter kind's implicit-GEMM tile.
TILE_FIELDS = {"kxk": "tile_conv_igemm_kxk", "1x1": "tile_conv_igemm_1x1"}


def fit_conv_tile(data: Mapping[str, Any], profile: Profile, policy: Policy,
                  lo: float = 16.0, hi: float = 1024.0) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """The k x k and the 1x1 tile (:data:`TILE_FIELDS`) at which the geometric mean of simulated /
    measured op times of that filter kind is 1, and their provenance; a range is the tiles at which the
    mean sits one mean absolute log error off (the per-op scatter). Each kind's ops depend on its own
    tile only, so both are bisected together (a larger tile means fewer passes)."""
    bounds = {kind: [math.log(lo), math.log(hi)] for kind in TILE_FIELDS}

    def at(tiles: dict[str, float]) -> dict[str, list[dict[str, Any]]]:
        fields = {TILE_FIELDS[k]: v for k, v in tiles.items()}
        samples = conv_samples(data["rows"], profile.replace(**fields), policy)
        by_kind = {k: [s for s in samples if s["kind"] == k] for k in TILE_FIELDS}
        if not all(by_kind.values()):
            raise ValueError("the fit needs act-remote rows with k x k and 1x1 convolution times")
        return by_kind

    for _ in range(12):
        mids = {k: (a + b) / 2 for k, (a, b) in bounds.items()}
        by_kind = at({k: math.exp(m) for k, m in mids.items()})
        for kind, samples in by_kind.items():
            too_slow = statistics.fmean(math.log(s["ratio"]) for s in samples) > 0
            bounds[kind][0 if too_slow else 1] = mids[kind]
    tiles = {k: round(math.exp((a + b) / 2), 1) for k, (a, b) in bounds.items()}
    by_kind = at(tiles)
    fields: dict[str, float] = {}
    provenance: dict[str, dict[str, Any]] = {}
    for kind, samples in by_kind.items():
        tile, field = tiles[kind], TILE_FIELDS[kind]
        scatter = statistics.fmean(abs(math.log(s["ratio"])) for s in samples)
        fields[field] = tile
        provenance[field] = {
            "value": tile, "range": [round(tile * math.exp(-scatter), 1), round(tile * math.exp(scatter), 1)],
            "source": f"bench/conv_in_step.py ({data.get('device', '?')}, {data.get('date', '?')}): "
                      f"{len(samples)} {kind} convolution ops of ResNet-50 (batch {data.get('batch_size')}) "
                      f"with activations remote; simulated / measured op time has geometric mean 1 at this "
                      f"tile, mean |log error| {scatter:.2f}",
            "mean_abs_log_error": round(scatter, 3),
        }
    return fields, provenance
