"""A model's and optimizer's state as one flat dict of tensors, and its strict restore.

Layout (the same as every Hadar checkpoint, so the tracker averages a user's replicas like
the zoo's): the model's ``state_dict`` entries under their own names, and the optimizer's
per-parameter state as ``optim.<i>.<name>`` where ``i`` is the parameter's position in
``model.parameters()``. Nothing is pickled; a non-tensor optimizer value (a float
``step``) is stored as a 0-d tensor.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["OPTIM_PREFIX", "StateMismatch", "state_tensors", "restore_state"]

OPTIM_PREFIX = "optim."


class StateMismatch(ValueError):
    """Tensors that do not fit the model (or optimizer) they are loaded into."""


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """Everything a checkpoint stores, as independent contiguous CPU tensors."""
    tensors = {name: _cpu_copy(t) for name, t in model.state_dict().items()}
    if optimizer is not None:
        index = {id(p): i for i, p in enumerate(model.parameters())}
        for param, state in optimizer.state.items():
            for name, value in state.items():
                if value is None:
                    continue
                tensor = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
                tensors[f"{OPTIM_PREFIX}{index[id(param)]}.{name}"] = _cpu_copy(tensor)
    return tensors


def restore_state(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                  tensors: dict[str, torch.Tensor]) -> bool:
    """Load the weights strictly (every tensor of the model, same shapes and dtypes, nothing
    else) and, if ``tensors`` holds any, the optimizer state. True if optimizer state was
    loaded. Raises :class:`StateMismatch` before changing anything if the weights do not fit."""
    weights = {k: v for k, v in tensors.items() if not k.startswith(OPTIM_PREFIX)}
    expected = model.state_dict()
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or extra:
        raise StateMismatch(f"checkpoint does not fit the model: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, value in weights.items():
        if value.shape != expected[name].shape or value.dtype != expected[name].dtype:
            raise StateMismatch(f"checkpoint tensor {name!r}: {value.dtype}{list(value.shape)}, "
                                f"model has {expected[name].dtype}{list(expected[name].shape)}")
    model.load_state_dict(weights, strict=True)
    optim = {k[len(OPTIM_PREFIX):]: v for k, v in tensors.items() if k.startswith(OPTIM_PREFIX)}
    if optimizer is None or not optim:
        return False
    _restore_optimizer(model, optimizer, optim)
    return True


def _restore_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer,
                       optim: dict[str, torch.Tensor]) -> None:
    params = list(model.parameters())
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in optim.items():
        index_text, _, name = key.partition(".")
        if not index_text.isdigit() or not name or int(index_text) >= len(params):
            raise StateMismatch(f"checkpoint optimizer tensor {OPTIM_PREFIX}{key!r} names no parameter")
        index = int(index_text)
        if name != "step" and value.shape != params[index].shape:
            raise StateMismatch(f"checkpoint optimizer tensor {OPTIM_PREFIX}{key!r}: shape "
                                f"{list(value.shape)}, parameter has {list(params[index].shape)}")
        state.setdefault(index, {})[name] = value
    # Optimizer state dicts number parameters in param_groups order; ours use model order.
    order = [id(p) for group in optimizer.param_groups for p in group["params"]]
    position = {id(p): i for i, p in enumerate(params)}
    if sorted(position[pid] for pid in order) != list(range(len(params))):
        raise StateMismatch("optimizer does not hold exactly the model's parameters")
    current = optimizer.state_dict()
    current["state"] = {slot: state[position[pid]] for slot, pid in enumerate(order) if position[pid] in state}
    optimizer.load_state_dict(current)
