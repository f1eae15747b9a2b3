"""Reading JSON documents from packages with every field checked: a malformed
document raises :class:`PackageError` naming the file and the field, never a
``KeyError``, ``TypeError`` or ``UnicodeDecodeError`` from deep inside."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import PackageError

__all__ = ["Field", "read_json"]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Field:
    """One value of a JSON document, with where it came from."""

    def __init__(self, value: Any, file: str, path: str = "") -> None:
        self.value = value
        self.file = file
        self.path = path

    def where(self, key: str | None = None) -> str:
        path = self._child_path(key) if key is not None else self.path
        return f"{self.file}: field '{path}'" if path else f"{self.file}"

    def _child_path(self, key: str | int) -> str:
        if isinstance(key, int):
            return f"{self.path}[{key}]"
        return f"{self.path}.{key}" if self.path else key

    def _fail(self, expected: str) -> PackageError:
        return PackageError(f"{self.where()} must be {expected}, got {_short(self.value)}")

    def _object(self) -> dict[str, Any]:
        if not isinstance(self.value, dict):
            raise self._fail("a JSON object")
        return self.value

    def __getitem__(self, key: str) -> Field:
        obj = self._object()
        if key not in obj:
            raise PackageError(f"{self.where(key)} is missing")
        return Field(obj[key], self.file, self._child_path(key))

    def get(self, key: str) -> Field | None:
        """The field, or None when it is missing or null."""
        value = self._object().get(key)
        return None if value is None else Field(value, self.file, self._child_path(key))

    def items(self) -> list[Field]:
        if not isinstance(self.value, list):
            raise self._fail("a JSON list")
        return [Field(v, self.file, self._child_path(i)) for i, v in enumerate(self.value)]

    def string(self) -> str:
        if not isinstance(self.value, str):
            raise self._fail("a string")
        return self.value

    def strings(self) -> list[str]:
        return [item.string() for item in self.items()]

    def boolean(self) -> bool:
        if not isinstance(self.value, bool):
            raise self._fail("true or false")
        return self.value

    def integer(self, minimum: int | None = None) -> int:
        if not isinstance(self.value, int) or isinstance(self.value, bool):
            raise self._fail("an integer")
        if minimum is not None and self.value < minimum:
            raise self._fail(f"an integer >= {minimum}")
        return self.value

    def integer_or_none(self, minimum: int | None = None) -> int | None:
        return None if self.value is None else self.integer(minimum)

    def json_string(self) -> Field:
        """A string that holds a JSON document, parsed."""
        try:
            return Field(json.loads(self.string()), self.file, self.path)
        except json.JSONDecodeError as e:
            raise PackageError(f"{self.where()} is not valid JSON: {e}") from None


def read_json(path: Path) -> Field:
    """The JSON document in the file at `path`."""
    try:
        text = path.read_bytes().decode("utf-8")
        return Field(json.loads(text), str(path))
    except OSError as e:
        raise PackageError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise PackageError(f"{path} is not a text (UTF-8) file") from None
    except json.JSONDecodeError as e:
        raise PackageError(f"{path} is not valid JSON: {e}") from None
