"""Large language models on aoti_sessions: export a transformers causal LM
into one package (``export``)."""

from __future__ import annotations

from ._export import export

__all__ = ["export"]
