"""What export checks before it writes a package, and how it says a failure:
a package whose compiled code refuses a shape it declares is never written
(llm/exporting/_export_check.py), and a model that cannot be traced is named with the
layer and operation that failed (llm/exporting/_export_errors.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers

from aoti_sessions.errors import ExportError
from aoti_sessions.llm.exporting import _export, _families, _fused
from aoti_sessions.llm.exporting._export_check import Refused, reason, refuses_one_row, stderr_read_back
from llm_models import FAST, KNOWN, _config, hf_model_dir


def test_the_families_export_names_as_tested_are_the_tests_families() -> None:
    """What a failed export says of a family (tested or not) is what the tests run."""
    assert sorted(_families.TESTED) == sorted(_config(arch, 512, {}).model_type for arch in KNOWN)


def _uncopied_part(self: _fused.FusedLinear, index: int, x: torch.Tensor) -> torch.Tensor:
    """A fused sibling's columns handed over as the slice itself (no copy):
    Inductor's view of it guards the rows > 1 (docs/aoti-runtime.md)."""
    if self._input is not x:
        self._input = x
        self._parts = tuple(torch.split(F.linear(x, self.weight, self.bias), self.widths, dim=-1))
    out = self._parts[index]
    if index == len(self.widths) - 1:
        self._input, self._parts = None, ()
    return out


def test_a_compiled_prefill_refusing_one_row_is_refused_at_export(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A package whose compiled prefill takes two rows at least though its
    trace declared one (Inductor narrows the row count while compiling; here
    its view of a fused projection's columns handed over uncopied, as export
    once did) is found by running the package before it is written: export
    compiles again for two rows (a lone session's call then pads a scratch
    row). Kept from that second try, it refuses the package, saying which call
    the code refused, before any request could meet it."""
    monkeypatch.setattr(_fused.FusedLinear, "part", _uncopied_part)
    monkeypatch.setattr(_export, "refuses_one_row", lambda refused: False)
    target = tmp_path / "qwen3.pt2"
    with pytest.raises(ExportError) as refused:
        _export.export(hf_model_dir("qwen3"), target, max_cache_len=64, max_prefill=16, max_batch=4,
                       inductor_configs=FAST)
    assert "the compiled 'prefill' refuses a call of 1 row of 2 tokens, which the package declares" in str(refused.value)
    assert "expected it to be >= 2, but got: 1" in str(refused.value)
    assert str(refused.value).endswith("no package written")
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_a_family_transformers_marks_uncompilable_is_refused_before_tracing(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A family transformers marks not compilable, whose state export does
    not keep itself, is refused at once, saying which families it keeps."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_model_dir("llama"), local_files_only=True)
    monkeypatch.setattr(type(model), "_can_compile_fullgraph", False)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM does not support a static KV cache in one graph .*"
                                         r"'llama' is not among the families whose state export keeps itself "
                                         r"\(falcon_h1, minimax, zamba2; docs/models.md: Families\)"):
        _export.export(model, tmp_path / "x.pt2")
    assert list(tmp_path.iterdir()) == []


def _data_dependent(self: Any, x: torch.Tensor) -> torch.Tensor:
    """A layer that branches on its input's values (untraceable with a dynamic input)."""
    if x.sum() > 0:
        return x * 2
    return x


def test_a_failed_export_says_the_layer_the_operation_and_the_family(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A Llama whose MLP branches on its input's values: the error names the
    model, the layer and the line it failed at, torch's error in a line, and
    that the family is a tested one; the command line prints the whole
    traceback with --verbose only."""
    from aoti_sessions.__main__ import main

    monkeypatch.setattr(transformers.models.llama.modeling_llama.LlamaMLP, "forward", _data_dependent)
    with pytest.raises(ExportError) as failed:
        _export.export(hf_model_dir("llama"), tmp_path / "x.pt2", max_cache_len=32, max_prefill=8, max_batch=2,
                       inductor_configs=FAST)
    message = str(failed.value)
    # (The innermost frame of code that is neither torch's nor a wrapper's: here the patched layer's.)
    assert message.startswith("export of LlamaForCausalLM failed in LlamaMLP._data_dependent "
                              "(test_export_checks.py:") and "`if x.sum() > 0:`): " in message
    assert "data-dependent" in message.lower() and "\n" not in message
    assert "'llama' is a family aoti-sessions runs exact in its tests" in message
    assert "aoti-sessions export --verbose" in message
    assert "Traceback" in failed.value.details and "_data_dependent" in failed.value.details
    assert not (tmp_path / "x.pt2").exists()
    for flags, traceback_shown in (([], False), (["--verbose"], True)):
        argv = ["export", str(hf_model_dir("llama")), "-o", str(tmp_path / "x.pt2"), "--max-cache-len", "32",
                "--max-prefill", "8", "--max-batch", "2", *flags]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.rstrip().splitlines()[-1] == f"aoti-sessions: error: {message}"
        assert ("Traceback (most recent call last)" in err) == traceback_shown


def test_a_refusal_printed_by_an_older_runtime_is_read_back(capfd: pytest.CaptureFixture[str]) -> None:
    """torch 2.11's compiled code prints why it refused a call to stderr (2.13
    hands it to the core): the check reads that line back, so export still
    tells a prefill that needs two rows (and compiles again) on the GPU
    machine's torch; what was printed still reaches stderr."""
    printed: list[str] = []
    with stderr_read_back(printed):
        os.write(2, b"Error: input_handles[0]: dim value is too small at 0, expected it to be >= 2, but got: 1\n")
    assert "dim value is too small" in capfd.readouterr().err
    message = "running the model failed for prefill: the model runtime printed the reason to stderr"
    refused = Refused("prefill", 1, 2, reason(message, "".join(printed)))
    assert refused.reason == "input_handles[0]: dim value is too small at 0, expected it to be >= 2, but got: 1"
    assert refuses_one_row(refused)
    assert not refuses_one_row(Refused("prefill", 1, 2, reason(message, "")))
    # The core's own message wins where it has one (torch 2.13).
    assert reason("running the model failed for decode: too large", "Error: other\n") == "too large"
