"""triton, where it is installed (CPU installs have none): the kernel
modules (``_gemv.py``, ``_kv_write.py``, ``_paged_attention.py``) define
their kernels and ops only where ``triton`` is not None, and take their
reference paths otherwise. Typed Any: mypy can type neither triton (no
stubs) nor kernel bodies."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["triton", "tl"]

triton: Any = None
tl: Any = None
if not TYPE_CHECKING:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        pass
