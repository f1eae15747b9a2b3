"""Export's last check: the compiled package loaded and each method run once
at the smallest and the largest shapes its signature declares (one row and
the most rows, the fewest and the most prefill tokens), before the package
is written. The compiled code can accept less than the trace declared
(Inductor may specialise a dimension after export: a prefill compiled for
two rows or more, say); a package whose first request would fail is never
written.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..._engine import Engine
from ...errors import RunError

__all__ = ["Refused", "check_shapes", "reason", "refuses_one_row", "stderr_read_back"]

# What the compiled wrapper says of an input dimension below its range.
_RUN_FAILED = re.compile(r"running the model failed for \S+: ")
# Where a runtime older than torch 2.13 says why a call failed: a line on stderr (the core's message then
# says so), which the check reads back.
_PRINTED = re.compile(r"^Error: (.+)$", re.MULTILINE)
_TOO_SMALL = re.compile(r"dim value is too small at (\d+), expected it to be >= (\d+), but got: (\d+)")


@dataclass(frozen=True)
class Refused(Exception):
    """A method's compiled code refused a call of a shape the package declares."""

    method: str
    rows: int
    tokens: int
    reason: str

    def __str__(self) -> str:
        return (f"the compiled '{self.method}' refuses a call of {self.rows} row{'s' * (self.rows != 1)} of "
                f"{self.tokens} token{'s' * (self.tokens != 1)}, which the package declares: {self.reason}")


def refuses_one_row(refused: Refused) -> bool:
    """Whether ``refused`` is the compiled code asking for two rows or more
    of a call of one (the engine pads such a call where the package says so)."""
    found = _TOO_SMALL.search(refused.reason)
    return refused.rows == 1 and found is not None and found.group(1) == "0" and found.group(2) == "2"


def check_shapes(path: str, device: torch.device, vocab: int, max_prefill: int, prefill_rows: int,
                 max_batch: int) -> None:
    """Runs ``path``'s prefill at (1 row, 2 tokens), (1 row, ``max_prefill``)
    and (``prefill_rows`` rows, 2 tokens), and its decode at 1 and
    ``max_batch`` rows (and decode_one where it has it), each on sessions of
    its own (random token ids);
    raises :class:`Refused` for the first the compiled code refuses."""
    cases = [("prefill", 1, 2), ("prefill", 1, max_prefill), ("prefill", prefill_rows, 2), ("decode", 1, 1),
             ("decode", max_batch, 1)]
    generator = torch.Generator().manual_seed(0)
    with Engine(path, device=device, max_sessions=max(prefill_rows, max_batch), cuda_graphs=False) as engine:
        for method, rows, tokens in dict.fromkeys(cases + [("decode_one", 1, 1)] * ("decode_one" in engine.methods)):
            sessions = [engine.new_session() for _ in range(rows)]
            printed: list[str] = []
            try:
                ids = torch.randint(0, vocab, (rows, tokens), generator=generator).to(device)
                with stderr_read_back(printed):
                    engine.run_batch(method, sessions, ids)
            except RunError as e:
                raise Refused(method, rows, tokens, reason(str(e), "".join(printed))) from None
            finally:
                for s in sessions:
                    s.close()


def reason(message: str, printed: str) -> str:
    """Why a run failed: the core's ``message``, or where that says the
    runtime printed it, the runtime's last ``Error:`` line in ``printed``."""
    said = _RUN_FAILED.sub("", message).strip()
    lines = _PRINTED.findall(printed)
    return lines[-1].strip() if lines and "printed the reason to stderr" in said else said


@contextmanager
def stderr_read_back(into: list[str]) -> Iterator[None]:
    """What the process writes to its stderr (file descriptor 2, where C++
    prints) during the block, appended to ``into`` and written on to stderr
    after it: nothing is lost, and the check can read the runtime's reason."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read()
            if text:
                os.write(2, text)
            into.append(text.decode(errors="replace"))
