"""Out of memory in a run: recognising it (:func:`is_oom`: PyTorch's error, the host's, the CUDA libraries'),
freeing the caching allocator once the exception is gone (:func:`free_memory`), the exception that ends a
multi-process job (:class:`RankOutOfMemory`) and an error as the one line a summary records (:func:`error_line`).
"""

from __future__ import annotations

import gc

import torch

__all__ = ["OOM_MESSAGES", "RankOutOfMemory", "error_line", "free_memory", "is_oom"]


class RankOutOfMemory(RuntimeError):
    """One rank of a multi-process run ran out of memory; its marker is written and the job must end."""


#: Messages of the errors that mean an allocation failed: PyTorch's, the host's, and those of the CUDA libraries
#: (cuBLAS, cuSOLVER, cuSPARSE, cuFFT, cuDNN) and the runtime, which do not raise ``torch.OutOfMemoryError``.
OOM_MESSAGES = (
    "out of memory",
    "can't allocate memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUSOLVER_STATUS_ALLOC_FAILED",
    "CUSPARSE_STATUS_ALLOC_FAILED",
    "CUFFT_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cudaErrorMemoryAllocation",
    "CUDA_ERROR_OUT_OF_MEMORY",
)


def is_oom(err: BaseException) -> bool:
    """Whether an exception means the device (or host) ran out of memory."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(m.lower() in text for m in OOM_MESSAGES)


def free_memory(device: torch.device | None) -> None:
    gc.collect()
    if getattr(device, "type", None) == "cuda":
        torch.cuda.empty_cache()


def error_line(err: BaseException) -> str:
    """An exception as one line: its type and its message, whitespace folded, at most 300 characters."""
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
