"""Host mappings page-locked with the CUDA driver for exactly as long as a view reads them.

    mapping = RegisteredMapping(-1, nbytes)                  # an mmap: anonymous, or of a file
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)
    mapping.register(tensor.data_ptr(), nbytes, what=f"{nbytes} bytes")   # RuntimeError if refused

One mechanism for every page-locked mapping of the package: exact-size pinned masters
(`residency.device.transport`), node-shared segments (`residency.multirank.shared_memory`) and
warm-restart cache files (`residency.host.master_cache`).  ``torch.frombuffer(mapping)`` keeps
the mapping alive, so the pages stay mapped and registered exactly as long as some tensor still
reads them; the mapping's end (`__del__`, when the last view dies) unregisters them.
"""

from __future__ import annotations

import mmap

import torch

__all__ = ["RegisteredMapping"]


class RegisteredMapping(mmap.mmap):
    """An mmap whose pages may be registered for DMA (`register`); unregistered when it dies."""

    #: The address registered with ``cudaHostRegister``, or 0 (not page-locked).
    registered = 0

    def register(self, pointer: int, nbytes: int, what: str) -> None:
        """Page-lock `nbytes` from `pointer` (inside this mapping); `what` names them in the
        RuntimeError raised when the driver refuses (the caller decides whether to go on
        pageable)."""
        cudart = torch.cuda.cudart()
        status = cudart.cudaHostRegister(pointer, nbytes, 0)
        if int(status) != 0:
            # Clear the sticky last-error, or the next kernel launch check would report it.
            getattr(cudart, "cudaGetLastError", lambda: None)()
            raise RuntimeError(f"cudaHostRegister of {what} failed with CUDA error {int(status)}")
        self.registered = pointer

    def __del__(self) -> None:
        if self.registered:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.registered)
            except Exception:  # interpreter shutdown: the driver may already be gone
                pass
