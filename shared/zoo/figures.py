"""Job figures of a zoo model, for the profiler's throughput estimate.

Everything is counted, not guessed, from one real training step at the given batch size
on CPU (oneDNN off, so LSTMs decompose into counted matrix products):

* FLOPs with ``torch.utils.flop_counter.FlopCounterMode`` -- forward only, and forward
  plus backward -- divided by the batch size (matrix products and convolutions only;
  element-wise work is small beside them for these models);
* activation bytes: tensors autograd saves for backward (``saved_tensors_hooks``),
  each storage counted once, per sample;
* framework ops per step: aten operators dispatched by forward, backward, ``zero_grad``
  and the optimizer step (a proxy for kernel launches on a GPU);
* optimizer slots: state tensors per parameter (SGD with momentum 1, Adam/AdamW 2).

Results are deterministic functions of the arguments and cached per process.
:func:`job_figures` returns them as the estimator's :class:`shared.domain.workloads.JobFigures`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from shared.domain.workloads import JobFigures
from shared.zoo.datasets import load_dataset
from shared.zoo.models import build_model, parse_model_name
from shared.zoo.optim import OPTIMIZER_SLOTS, make_optimizer
from shared.zoo.tasks import loss_function

__all__ = ["ModelFigures", "model_figures", "job_figures", "DEFAULT_DATASET"]

DEFAULT_DATASET: dict[str, str] = {   # family -> the dataset figures use when none is named
    "autoencoder": "synthetic-ratings",
    "lstm": "synthetic-text",
    "resnet": "digits",
    "transformer": "synthetic-text",
}


@dataclass(frozen=True, kw_only=True)
class ModelFigures:
    model: str
    dataset: str
    batch_size: int
    params: int                       # trainable parameters
    param_bytes: int                  # their size in memory (float32)
    flops_per_sample: float           # one training step (forward + backward), per sample
    forward_flops_per_sample: float   # inference only, per sample
    input_bytes_per_sample: int       # what crosses PCIe per sample (inputs + targets)
    activation_bytes_per_sample: int  # saved for backward, per sample
    ops_per_step: int                 # aten ops of forward, backward, zero_grad, optimizer step


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves TorchDispatchMode.__init__ unannotated
        self.ops = 0

    def __torch_dispatch__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


@functools.cache
def model_figures(model_name: str, batch_size: int, dataset: str | None = None,
                  optimizer: str = "sgd") -> ModelFigures:
    """Counted figures of ``model_name`` trained on ``dataset`` (default: its family's)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    name = parse_model_name(model_name)
    data = load_dataset(dataset or DEFAULT_DATASET[name.family])
    model = build_model(model_name, data.info, seed=0)
    opt = make_optimizer(optimizer, model.parameters(), lr=0.01)
    loss_fn = loss_function(data.info.task)
    index = torch.arange(batch_size) % len(data.train_x)
    x, y = data.train_x[index], data.train_y[index]
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.backends.mkldnn.flags(enabled=False):
            with FlopCounterMode(display=False) as forward, torch.no_grad():
                model(x)
            with FlopCounterMode(display=False) as training:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    loss = loss_fn(model(x), y)
                loss.backward()
            opt.zero_grad()
            with _OpCounter() as counter:
                loss = loss_fn(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
    params = [p for p in model.parameters() if p.requires_grad]
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    activations = sum(n for ptr, n in saved.items() if ptr not in param_ptrs)
    return ModelFigures(
        model=model_name, dataset=data.info.name, batch_size=batch_size,
        params=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        flops_per_sample=training.get_total_flops() / batch_size,
        forward_flops_per_sample=forward.get_total_flops() / batch_size,
        input_bytes_per_sample=(x.numel() * x.element_size() + y.numel() * y.element_size()) // batch_size,
        activation_bytes_per_sample=activations // batch_size,
        ops_per_step=counter.ops,
    )


def job_figures(model_name: str, batch_size: int, dataset: str | None = None,
                optimizer: str = "sgd") -> JobFigures:
    """The estimator's view of one worker of a zoo job (every zoo model is DDP-capable)."""
    f = model_figures(model_name, batch_size, dataset, optimizer)
    return JobFigures(
        family=f.model, flops_per_sample=f.forward_flops_per_sample, params=f.params,
        batch_size=batch_size, input_bytes_per_sample=f.input_bytes_per_sample,
        activation_bytes_per_sample=f.activation_bytes_per_sample, ops_per_step=f.ops_per_step,
        optimizer_slots=OPTIMIZER_SLOTS[optimizer], distributed=True,
    )
