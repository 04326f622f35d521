"""Model files that say what they are, and the module that fits them.

:func:`describe` is what the tracker writes into every round and final model
(:class:`shared.domain.model_meta.ModelDescription`): the zoo model and dataset names, the
model's width and depth, the zoo's view of it (family, task, input shape, outputs), the
library version, and the samples trained. :func:`build_from_metadata` turns that back into
a freshly initialised ``torch.nn.Module`` whose ``state_dict`` has exactly the file's
tensors, so loading is strict::

    from safetensors import safe_open; from safetensors.torch import load_file
    from shared.zoo import build_from_metadata
    model = build_from_metadata(safe_open("m.safetensors", "pt").metadata())
    model.load_state_dict(load_file("m.safetensors"), strict=True)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version

from torch import nn

from shared.domain.model_meta import InvalidModelMetadata, ModelDescription
from shared.errors import UsageError
from shared.wire.records import JobSpec
from shared.zoo.datasets import dataset_info
from shared.zoo.models import build_model, parse_model_name

__all__ = ["describe", "build_from_metadata", "library_version"]


def library_version() -> str:
    """``hadar <version>`` of the installed package (``hadar unknown`` when run from a tree
    that is not installed)."""
    try:
        return f"hadar {version('hadar')}"
    except PackageNotFoundError:
        return "hadar unknown"


def describe(spec: JobSpec, *, worker_steps: int) -> ModelDescription:
    """The description of a model of ``spec`` trained for ``worker_steps`` per-worker batches.

    Raises ``ValueError`` if the zoo does not know the model or the dataset.
    """
    name = parse_model_name(spec.model)
    info = dataset_info(spec.dataset)
    zoo = {"family": name.family, "width": name.width, "depth": name.depth, "task": info.task,
           "input_shape": list(info.input_shape), "n_outputs": info.n_outputs}
    return ModelDescription(model=spec.model, dataset=spec.dataset, width=name.width, depth=name.depth,
                            zoo=json.dumps(zoo, separators=(",", ":"), sort_keys=True), library=library_version(),
                            samples=worker_steps * spec.batch_size)


def build_from_metadata(meta: Mapping[str, str] | None) -> nn.Module:
    """A fresh module of the model a file's ``__metadata__`` describes (its weights are the
    zoo's initialisation; load the file's tensors into it). :class:`UsageError` if the
    metadata has no description (a file not written by Hadar's tracker, or written before
    models described themselves) or names what this zoo cannot build."""
    try:
        description = ModelDescription.from_metadata(meta or {})
    except InvalidModelMetadata as exc:
        raise UsageError(str(exc)) from None
    if description is None:
        raise UsageError("the file's metadata names no model (not a Hadar model, or one from before 0.1.0 "
                         "described itself): build the module from the job's model and dataset")
    try:
        return build_model(description.model, dataset_info(description.dataset), seed=0)
    except ValueError as exc:
        raise UsageError(f"cannot build {description.model!r} on {description.dataset!r}: {exc}") from None
