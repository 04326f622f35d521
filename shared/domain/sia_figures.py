"""Estimator figures for the five applications of Sia's Philly workloads.

Sia (SOSP'23, github.com/siasosp23/artifacts) and Pollux (OSDI'21) before it measured step
times of these applications on T4, RTX 2080 Ti and A100 nodes
(``shared/domain/data/sia/profiles``). The figures below describe the models and how the
artifact's training scripts run them (github.com/suhasjs/adaptdl, ``benchmark/models/<app>``:
PyTorch 1.9, CUDA 11.1, cuDNN 8, AdaptDL), not those measurements: parameters and forward FLOPs
from the models' papers and those scripts (a multiply-add is two FLOPs, as in
``shared.domain.workloads``); saved activations and forward op counts are order-of-magnitude
estimates ("est."). They are what the roofline estimator (``shared.domain.gpus``) reads for a job
the profiler has not measured, and ``benchmarks/estimator_sia.py`` scores them against the
measured step times they were not fitted on.

===========  ==================================  =======  =========  ============  ==========
application  model / data                        params   fwd FLOPs  act/sample    optimizer
===========  ==================================  =======  =========  ============  ==========
cifar10      ResNet-18 (CIFAR variant), CIFAR-10  11.2M    1.11 G     4.7 MB        SGD mom.
imagenet     ResNet-50, ImageNet 224x224          25.6M    8.18 G     86 MB         SGD mom.
bert         BERT-base fine-tuned on SQuAD,       109.5M   70.7 G     550 MB (est.) AdamW
             384 tokens: 2 x 85M encoder
             weights x 384 + attention 5.4 G
deepspeech2  DeepSpeech2 as train.py builds it:   41.2M    25.9 G     60 MB (est.)  SGD mom.
             2 conv (41x11, 21x11; 32 ch) + 5
             bidirectional GRU of 800, 161 bins;
             VoxForge ~5 s utterances (est.):
             250 steps after the stride-2 conv
yolov3       YOLOv3 (Darknet-53), PASCAL VOC at   61.9M    76.4 G     460 MB (est.) SGD mom.
             448x448 (its config's TRAIN_IMG_SIZE;
             65.9 G at 416 in the YOLOv3 paper)
===========  ==================================  =======  =========  ============  ==========

Precision: imagenet and yolov3 call apex ``amp.initialize`` (O1, mixed precision). The other
three train in FP32, which PyTorch 1.9 runs as TF32 on Ampere tensor cores (``tf32``: its
``allow_tf32`` defaults were on for cuBLAS and cuDNN) -- except deepspeech2, whose cuDNN GRUs get
packed variable-length batches of arbitrary size, outside the sizes (multiples of 8) cuDNN's
RNN tensor-op paths are documented for, so they run on FP32 CUDA cores. That one is an
inference from the profiles, not from the scripts: its measured rates on the three types
follow their FP32 peaks, so ``benchmarks/estimator_sia.py`` does not score it blind.

Framework ops (``ops_per_step``, each charged ``gpus.HOST_SECONDS_PER_OP``) are counted from the
scripts: three times the forward ops (forward, then about two backward kernels per forward op),
plus per parameter tensor: the optimizer's update (SGD with momentum 3, with weight decay 4;
transformers' AdamW 8), zero_grad (1), ``clip_grad_norm_`` (2: a norm, a scale), apex's
Python-fallback unscale (3: a sum, a device-to-host check, a scale; the Dockerfiles build apex
without its CUDA extension) and AdaptDL's GradientNoiseScale (adaptdl/torch/gradient_noise_scale.py:
9 -- squared norm in the backward hook, scaling, squared norm of the synchronised gradient --
and 9 more on one replica, which differences successive gradients instead). Loader work on the
host (JPEG decoding, spectrograms, augmentation) runs in worker processes outside AdaptDL's
timed step and is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType

from shared.domain.workloads import FAMILIES, JobFigures

__all__ = ["SIA_APPLICATIONS", "sia_figures", "GNS_OPS_PER_TENSOR", "GNS_SINGLE_REPLICA_OPS_PER_TENSOR"]

_MB = 1_000_000
GNS_OPS_PER_TENSOR = 9                 # AdaptDL GradientNoiseScale, per parameter tensor and step
GNS_SINGLE_REPLICA_OPS_PER_TENSOR = 9  # ... and on one replica, its difference estimator's extra


@dataclass(frozen=True, kw_only=True)
class _Run:
    """How the artifact's script runs an application, for its framework op count."""

    forward_ops: int         # one forward pass with its loss and metrics (est.)
    param_tensors: int       # counted from the architecture
    optimizer_ops: int       # per parameter tensor
    clip: bool = False       # clip_grad_norm_ every step
    apex: bool = False       # apex amp O1, Python-fallback unscale

    def ops(self, replicas: int) -> int:
        per_tensor = self.optimizer_ops + 1 + GNS_OPS_PER_TENSOR
        per_tensor += (2 if self.clip else 0) + (3 if self.apex else 0)
        per_tensor += GNS_SINGLE_REPLICA_OPS_PER_TENSOR if replicas == 1 else 0
        return 3 * self.forward_ops + self.param_tensors * per_tensor


# Forward ops: ResNet-18 20 conv + 20 BN + 17 ReLU + 8 adds + head and accuracy; ResNet-50 175
# layers + ~110 apex casts + accuracy; BERT-base ~25 per layer x 12 + embeddings and heads;
# DeepSpeech2 convs with masking, per layer BN, pack, GRU, unpack, sum, plus CTC; YOLOv3 ~250
# layers + ~150 apex casts + ~300 for its three scales' GIoU, confidence and class losses.
_RUNS = MappingProxyType({
    "cifar10": _Run(forward_ops=75, param_tensors=62, optimizer_ops=4),
    "imagenet": _Run(forward_ops=300, param_tensors=161, optimizer_ops=4, apex=True),
    "bert": _Run(forward_ops=330, param_tensors=199, optimizer_ops=8, clip=True),
    "deepspeech2": _Run(forward_ops=100, param_tensors=59, optimizer_ops=3, clip=True),
    "yolov3": _Run(forward_ops=700, param_tensors=222, optimizer_ops=4, apex=True),
})

_FIGURES = {
    "cifar10": replace(FAMILIES["ResNet-18"], family="cifar10", tf32=True),
    "imagenet": replace(FAMILIES["ResNet-50"], family="imagenet", tf32=True, mixed_precision=True),
    "bert": JobFigures(
        family="bert", flops_per_sample=70.7e9, params=109_483_778, batch_size=1,
        input_bytes_per_sample=3 * 384 * 8, activation_bytes_per_sample=550 * _MB,
        ops_per_step=1, optimizer_slots=2, tf32=True, distributed=True),
    # 161 bins x 500 frames of 10 ms in; conv1 32x81x250 outputs x 451 MACs, conv2 32x41x250 x 7392,
    # GRUs 2 x 2400 x (2112 + 4 x 1600) weights x 250 steps: 12.9 G multiply-adds.
    "deepspeech2": JobFigures(
        family="deepspeech2", flops_per_sample=25.9e9, params=41_188_000, batch_size=1,
        input_bytes_per_sample=161 * 500 * 4, activation_bytes_per_sample=60 * _MB,
        ops_per_step=1, optimizer_slots=1, distributed=True),
    "yolov3": JobFigures(
        family="yolov3", flops_per_sample=65.9e9 * (448 / 416) ** 2, params=61_949_149, batch_size=1,
        input_bytes_per_sample=3 * 448 * 448 * 4, activation_bytes_per_sample=460 * _MB,
        ops_per_step=1, optimizer_slots=1, mixed_precision=True, tf32=True, distributed=True),
}

# One replica's figures (one GPU); sia_figures gives them for any replica count.
SIA_APPLICATIONS: MappingProxyType[str, JobFigures] = MappingProxyType({
    app: replace(job, ops_per_step=_RUNS[app].ops(1)) for app, job in _FIGURES.items()})


def sia_figures(application: str, local_batch: int, replicas: int = 1) -> JobFigures:
    """``application``'s figures at ``local_batch`` samples per GPU on ``replicas`` GPUs (the op
    count depends on it); ValueError if unknown."""
    if application not in SIA_APPLICATIONS:
        raise ValueError(f"no figures for {application!r}; known: {', '.join(SIA_APPLICATIONS)}")
    if local_batch < 1 or replicas < 1:
        raise ValueError("local_batch and replicas must be >= 1")
    return replace(SIA_APPLICATIONS[application], batch_size=local_batch, ops_per_step=_RUNS[application].ops(replicas))
