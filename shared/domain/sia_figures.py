"""Estimator figures for the five applications of Sia's Philly workloads.

Sia (SOSP'23, github.com/siasosp23/artifacts) and Pollux (OSDI'21) before it measured step
times of these applications on T4, RTX 2080 Ti and A100 nodes
(``shared/domain/data/sia/profiles``). The figures below describe the models, not those
measurements: parameters and forward FLOPs from the models' papers and standard
implementations (a multiply-add is two FLOPs, as in ``shared.domain.workloads``); saved
activations and framework ops are order-of-magnitude estimates ("est."). They are what the
roofline estimator (``shared.domain.gpus``) reads for a job the profiler has not measured,
and ``benchmarks/estimator_sia.py`` scores them against the measured step times
they were not fitted on.

===========  ==================================  =======  =========  ============  ==========
application  model / data                        params   fwd FLOPs  act/sample    optimizer
===========  ==================================  =======  =========  ============  ==========
cifar10      ResNet-18 (CIFAR variant), CIFAR-10  11.2M    1.11 G     4.7 MB        SGD mom.
imagenet     ResNet-50, ImageNet 224x224          25.6M    8.18 G     86 MB         SGD mom.
bert         BERT-base fine-tuned on SQuAD,       109.5M   70.7 G     550 MB (est.) AdamW
             384 tokens: 2 x 85M encoder
             weights x 384 + attention 5.4 G
deepspeech2  DeepSpeech2 (2 conv + 5 bidirectional 86.6M   29 G       100 MB (est.) SGD mom.
             LSTM of 1024), 161 spectrogram bins,
             ~3 s utterances: 150 steps after the
             stride-2 convolutions (est.)
yolov3       YOLOv3 (Darknet-53), PASCAL VOC      61.9M    65.9 G     400 MB (est.) SGD mom.
             at 416x416 (YOLOv3 paper's count)
===========  ==================================  =======  =========  ============  ==========

Four train in FP32, which on Ampere GPUs runs as TF32 on tensor cores (``tf32``): the
measured A100 rates exceed the A100's FP32 peak (cifar10 at 2,051 samples per GPU: 31 TFLOPS
achieved against 19.5), which only tensor cores allow. imagenet trains in mixed precision:
its profiles run 200 samples per GPU on an 11 GB RTX 2080 Ti, where ResNet-50's FP32
activations alone would take 17 GB. Loader work on the host (JPEG decoding,
spectrograms, mosaic augmentation) is not modelled: it depends on the node's CPUs, which the
GPU catalog does not describe.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

from shared.domain.workloads import FAMILIES, JobFigures

__all__ = ["SIA_APPLICATIONS", "sia_figures"]

_MB = 1_000_000

SIA_APPLICATIONS: MappingProxyType[str, JobFigures] = MappingProxyType({
    "cifar10": replace(FAMILIES["ResNet-18"], family="cifar10", tf32=True),
    "imagenet": replace(FAMILIES["ResNet-50"], family="imagenet", tf32=True, mixed_precision=True),
    "bert": JobFigures(
        family="bert", flops_per_sample=70.7e9, params=109_483_778, batch_size=1,
        input_bytes_per_sample=3 * 384 * 8, activation_bytes_per_sample=550 * _MB,
        ops_per_step=3300, optimizer_slots=2, tf32=True, distributed=True),
    "deepspeech2": JobFigures(
        family="deepspeech2", flops_per_sample=29e9, params=86_600_000, batch_size=1,
        input_bytes_per_sample=161 * 300 * 4, activation_bytes_per_sample=100 * _MB,
        ops_per_step=400, optimizer_slots=1, tf32=True, distributed=True),
    "yolov3": JobFigures(
        family="yolov3", flops_per_sample=65.9e9, params=61_949_149, batch_size=1,
        input_bytes_per_sample=3 * 416 * 416 * 4, activation_bytes_per_sample=400 * _MB,
        ops_per_step=1500, optimizer_slots=1, tf32=True, distributed=True),
})


def sia_figures(application: str, local_batch: int) -> JobFigures:
    """``application``'s figures at ``local_batch`` samples per GPU; ValueError if unknown."""
    if application not in SIA_APPLICATIONS:
        raise ValueError(f"no figures for {application!r}; known: {', '.join(SIA_APPLICATIONS)}")
    if local_batch < 1:
        raise ValueError("local_batch must be >= 1")
    return replace(SIA_APPLICATIONS[application], batch_size=local_batch)
