"""Model zoo: small members of the paper's workload families and datasets that need no download.

Use :func:`validate_job` at submission (it names the valid choices when a job asks for
something the zoo lacks), :func:`build_model` and :func:`load_dataset` to train, and
:func:`job_figures` (or the fuller :func:`model_figures`) for the profiler. See :mod:`shared.zoo.models` and
:mod:`shared.zoo.datasets` for what each name means.
"""

from __future__ import annotations

from shared.wire.events import JobSpec
from shared.zoo.datasets import (
    DATASETS,
    Dataset,
    DatasetInfo,
    dataset_info,
    load_dataset,
)
from shared.zoo.figures import DEFAULT_DATASET, ModelFigures, job_figures, model_figures
from shared.zoo.meta import build_from_metadata, describe, library_version
from shared.zoo.models import (
    MODELS,
    SUPPORTS,
    ModelName,
    build_model,
    check_supported,
    parse_model_name,
)
from shared.zoo.optim import OPTIMIZERS, make_optimizer
from shared.zoo.tasks import Metric, evaluate, loss_function

__all__ = [
    "MODELS", "DATASETS", "SUPPORTS", "DEFAULT_DATASET", "validate_job", "build_model", "load_dataset",
    "dataset_info", "model_figures", "ModelFigures", "ModelName", "parse_model_name", "Dataset",
    "DatasetInfo", "Metric", "evaluate", "loss_function", "compatible_datasets", "job_figures",
    "OPTIMIZERS", "make_optimizer", "build_from_metadata", "describe", "library_version",
]


def compatible_datasets(model: str) -> tuple[str, ...]:
    """Datasets ``model`` can train on (ValueError if the model name is unknown)."""
    family = parse_model_name(model).family
    return tuple(d for d in DATASETS if dataset_info(d).input_kind in SUPPORTS[family])


def validate_job(spec: JobSpec) -> None:
    """Reject a job the zoo cannot run; the ValueError message lists the valid names.

    Checks the model name (family and knobs), the dataset name, and that the model can
    train on that dataset.
    """
    name = parse_model_name(spec.model)
    if spec.dataset not in DATASETS:
        raise ValueError(f"dataset: unknown {spec.dataset!r}; valid: {', '.join(DATASETS)}")
    info = dataset_info(spec.dataset)
    try:
        check_supported(name, info)
    except ValueError as exc:
        valid = ", ".join(compatible_datasets(spec.model))
        raise ValueError(f"{exc}; valid datasets for {name.family}: {valid}") from None
