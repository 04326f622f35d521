"""``y += a * x`` in place with the BLAS axpy kernels, callable from several threads at once.

scipy's ``scipy.linalg.blas.saxpy``/``daxpy`` hold the GIL for the whole call, so threads
that accumulate chunks with them run one at a time. :func:`axpy` calls the *same* kernels
(the function pointers scipy exports in ``scipy.linalg.cython_blas``, hence the same
OpenBLAS build and the same result, bit for bit) through :mod:`ctypes`, which releases the
GIL for the duration of the call.

Guarantees: ``y`` (float32 or float64, C-contiguous, writable) becomes ``y + a * x``
element-wise exactly as ``scipy.linalg.blas.?axpy(x, y, a=a)`` computes it (``a`` is
rounded to ``y``'s dtype first, as scipy does); ``x`` must have ``y``'s dtype and size
and be C-contiguous. Sizes above 2**31-1 elements (BLAS's ``int``) are done in pieces.
Anything else raises ``ValueError``. A ctypes call costs about 4 us against scipy's
0.3 us, so ``release_gil=False`` (one thread) goes through scipy's wrapper instead: the
same kernel, the same result.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
from scipy.linalg.blas import daxpy, saxpy

__all__ = ["axpy"]

_MAX_N = 2**31 - 1
_P = ctypes.POINTER


def _kernel(name: str, real: type) -> Callable[..., None]:
    from scipy.linalg import cython_blas

    capsule = cython_blas.__pyx_capi__[name]
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    address = get_pointer(capsule, get_name(capsule))
    # Fortran BLAS: axpy(n*, a*, x*, incx*, y*, incy*). CFUNCTYPE (not PYFUNCTYPE) drops the GIL.
    proto = ctypes.CFUNCTYPE(None, _P(ctypes.c_int), _P(real), ctypes.c_void_p, _P(ctypes.c_int),
                             ctypes.c_void_p, _P(ctypes.c_int))
    return proto(address)


_KERNELS = {np.dtype(np.float32): (_kernel("saxpy", ctypes.c_float), ctypes.c_float),
            np.dtype(np.float64): (_kernel("daxpy", ctypes.c_double), ctypes.c_double)}
_ONE = ctypes.c_int(1)


def axpy(x: np.ndarray, y: np.ndarray, a: float, *, release_gil: bool = True) -> None:
    """``y += a * x`` in place (see the module's guarantees); ``release_gil``: let other
    threads run Python while the kernel runs."""
    entry = _KERNELS.get(y.dtype)
    if entry is None or x.dtype != y.dtype or x.size != y.size:
        raise ValueError(f"axpy needs two float32 or float64 arrays of one size, got {x.dtype}[{x.size}] "
                         f"and {y.dtype}[{y.size}]")
    if not (x.flags.c_contiguous and y.flags.c_contiguous and y.flags.writeable):
        raise ValueError("axpy needs C-contiguous arrays and a writable y")
    if not release_gil:
        result = (daxpy if y.dtype == np.float64 else saxpy)(x, y, a=a)
        if result is not y:  # the wrapper made a copy: keep y in place
            y[...] = result
        return
    kernel, real = entry
    weight = ctypes.byref(real(a))
    item = y.itemsize
    x_address, y_address = x.ctypes.data, y.ctypes.data
    for first in range(0, y.size, _MAX_N):
        n = min(_MAX_N, y.size - first)
        kernel(ctypes.byref(ctypes.c_int(n)), weight, x_address + first * item, ctypes.byref(_ONE),
               y_address + first * item, ctypes.byref(_ONE))
