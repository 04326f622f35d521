"""Hadar's SDK for a user's own training script (depends only on torch, numpy, safetensors).

See :mod:`hadar_sdk.run` for the loop and its guarantees, :class:`BatchSampler` for the
deterministic batch stream, and README "Bring your own training code".
"""

from hadar_sdk._version import __version__
from hadar_sdk.batches import BatchSampler
from hadar_sdk.run import Restored, Round, Run, SdkError, connect
from hadar_sdk.state import OPTIM_PREFIX, StateMismatch, restore_state, state_tensors

__all__ = ["BatchSampler", "OPTIM_PREFIX", "Restored", "Round", "Run", "SdkError", "StateMismatch", "__version__",
           "connect", "restore_state", "state_tensors"]
