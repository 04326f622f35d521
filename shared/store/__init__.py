"""Object stores for model checkpoints: one port, two implementations.

``LocalStore`` keeps objects in a directory (the embedded demo, unit tests);
``MinioStore`` talks to any S3 server (MinIO in development and deployments). Both pass
the same contract tests (tests/contract/test_store.py); see :class:`ObjectStore` for the
guarantees and :mod:`shared.store.base` for the key rules.
"""

from shared.store.base import (
    InvalidKey,
    ObjectNotFound,
    ObjectStore,
    StoreDenied,
    StoreUnavailable,
    validate_key,
    validate_prefix,
)
from shared.store.local import LocalStore
from shared.store.minio import MinioStore

__all__ = [
    "ObjectStore", "LocalStore", "MinioStore", "ObjectNotFound", "InvalidKey", "StoreDenied", "StoreUnavailable",
    "validate_key", "validate_prefix",
]
