"""What aoti_sessions.cluster uses of ``serve`` beyond its documented API:
public inside the package, so that the cluster never reaches into serve's
private modules, and one place says what it builds on (the middleware, the
error bodies, tenants and keys, metrics, limits, the LLM a process serves).
Each name is imported on first use: the cluster's command line reads its
options without FastAPI, which the web parts need."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._app import served_names
    from ._cli import prompt_options
    from ._errors import APIError, error_body, error_response, sse_error, unexpected
    from ._http import OnceAMinute, server_config
    from ._limits import available_memory, default_budgets
    from ._metrics import CONTENT_TYPE, Registry as MetricsRegistry, Sample, exposition, samples_of, summed
    from ._middleware import Cors, check_origins, request_id, unauthorized
    from ._open import open_llm
    from ._tenants import DEFAULT_TENANT, Keys, read_api_keys, scoped

# name: (module, its name there)
_WHERE = {
    "served_names": ("_app", "served_names"),
    "prompt_options": ("_cli", "prompt_options"),
    "APIError": ("_errors", "APIError"),
    "error_body": ("_errors", "error_body"),
    "error_response": ("_errors", "error_response"),
    "sse_error": ("_errors", "sse_error"),
    "unexpected": ("_errors", "unexpected"),
    "OnceAMinute": ("_http", "OnceAMinute"),
    "server_config": ("_http", "server_config"),
    "available_memory": ("_limits", "available_memory"),
    "default_budgets": ("_limits", "default_budgets"),
    "CONTENT_TYPE": ("_metrics", "CONTENT_TYPE"),
    "MetricsRegistry": ("_metrics", "Registry"),
    "Sample": ("_metrics", "Sample"),
    "exposition": ("_metrics", "exposition"),
    "samples_of": ("_metrics", "samples_of"),
    "summed": ("_metrics", "summed"),
    "Cors": ("_middleware", "Cors"),
    "check_origins": ("_middleware", "check_origins"),
    "request_id": ("_middleware", "request_id"),
    "unauthorized": ("_middleware", "unauthorized"),
    "open_llm": ("_open", "open_llm"),
    "DEFAULT_TENANT": ("_tenants", "DEFAULT_TENANT"),
    "Keys": ("_tenants", "Keys"),
    "read_api_keys": ("_tenants", "read_api_keys"),
    "scoped": ("_tenants", "scoped"),
}

__all__ = ["APIError", "CONTENT_TYPE", "Cors", "DEFAULT_TENANT", "Keys", "MetricsRegistry", "OnceAMinute",
           "Sample", "available_memory", "check_origins", "default_budgets", "error_body", "error_response",
           "exposition", "open_llm", "prompt_options", "read_api_keys", "request_id", "samples_of", "scoped",
           "served_names", "server_config", "sse_error", "summed", "unauthorized", "unexpected"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _WHERE[name]
    value = getattr(importlib.import_module(f"{__package__}.{module}"), attribute)
    globals()[name] = value
    return value
