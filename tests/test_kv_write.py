"""decode_one's q/k norms, rotary and cache write in one kernel
(llm/exporting/_kv_write.py): the reference against transformers' own
functions, bad input refused by name, the kernel against the reference
(triton's interpreter on the CPU, the real op on a GPU). That decode_one
through it leaves the pool and logits decode leaves is
tests/test_one_row.py's; the package's tokens, tests/test_decode_one.py's."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

from aoti_sessions.llm.exporting import _kv_write as kw
from conftest import requires_cuda, run_in_triton_interpreter
from llm_models import hf_model_dir

HAVE_TRITON = importlib.util.find_spec("triton") is not None
# (rows, query heads, kv heads, head_dim, q/k norms): head_dim 80 leaves half of a block masked.
CASES = [(3, 4, 2, 16, True), (2, 8, 8, 64, False), (1, 2, 1, 80, True), (1, 16, 8, 128, True)]


def _inputs(rows: int, hq: int, hkv: int, d: int, norm: bool, dtype: torch.dtype, device: str) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(rows * 100 + d)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    pages = 2 * rows + 1
    angles = torch.rand(rows, d // 2, generator=gen) * 6.3
    return {"qkv": rand(rows, (hq + 2 * hkv) * d), "cos": torch.cat([angles.cos()] * 2, 1).to(device, dtype),
            "sin": torch.cat([angles.sin()] * 2, 1).to(device, dtype),
            "kv": torch.zeros(pages, 3, 2, 4, hkv, d, dtype=dtype, device=device),
            "page": torch.randperm(pages, generator=gen)[:rows].to(device), "offset": torch.arange(rows).to(device) % 4,
            "layer": 1, "q_heads": hq, "kv_heads": hkv, "q_norm": rand(d).abs() + 0.5 if norm else None,
            "k_norm": rand(d).abs() + 0.5 if norm else None, "eps": 1e-6}


def _check_cases(dtype: torch.dtype, device: str, bf16_tol: float) -> None:
    for rows, hq, hkv, d, norm in CASES:
        a = _inputs(rows, hq, hkv, d, norm, dtype, device)
        ref_kv, got_kv = a["kv"].clone(), a["kv"].clone()
        ref = kw.rotary_kv_write_reference(**{**a, "kv": ref_kv})
        got = kw._launch(**{**a, "kv": got_kv})
        assert got.shape == ref.shape == (rows, hq, d) and got.dtype == ref.dtype
        # float32: the norm's sum in another order; bfloat16: units in the last place where that order
        # moves a rounding (``bf16_tol``).
        tol = 1e-5 if dtype == torch.float32 else bf16_tol
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol, msg=lambda m: f"queries {(rows, hq, hkv, d, norm)}: {m}")
        torch.testing.assert_close(got_kv, ref_kv, rtol=tol, atol=tol, msg=lambda m: f"pool {(rows, hq, hkv, d, norm)}: {m}")
        assert torch.count_nonzero(got_kv) == torch.count_nonzero(ref_kv) > 0  # (nothing outside the rows' slots)


def test_reference_is_the_model_formula() -> None:
    """Qwen3's q/k RMSNorms and transformers' rotary function, then the
    cache's write: the reference equals them bit for bit in bfloat16."""
    a = _inputs(3, 4, 2, 16, True, torch.bfloat16, "cpu")
    kv = a["kv"].clone()
    q = kw.rotary_kv_write_reference(**{**a, "kv": kv})
    heads = a["qkv"].reshape(3, 8, 16)
    norms = []
    for weight in (a["q_norm"], a["k_norm"]):
        norm = Qwen3RMSNorm(16, eps=1e-6).to(torch.bfloat16)
        norm.weight.data.copy_(weight)
        norms.append(norm)
    # transformers' layout: [B, H, T, D] with cos, sin [B, T, D]; here B = rows, T = 1.
    q_model, k_model = apply_rotary_pos_emb(norms[0](heads[:, :4])[:, :, None], norms[1](heads[:, 4:6])[:, :, None],
                                            a["cos"][:, None], a["sin"][:, None])
    assert torch.equal(q, q_model[:, :, 0])
    for row in range(3):
        page, offset = int(a["page"][row]), int(a["offset"][row])
        assert torch.equal(kv[page, 1, 0, offset], k_model[row, :, 0])
        assert torch.equal(kv[page, 1, 1, offset], heads[row, 6:])


@pytest.mark.parametrize("bad, message", [
    ({"kv": torch.zeros(4, 3, 2, 4, 2)}, "pool kv"),
    ({"layer": 3}, "layer 3 of 3"),
    ({"kv_heads": 1}, "kv heads"),
    ({"qkv": torch.zeros(3, 100)}, "qkv"),
    ({"cos": torch.zeros(3, 8)}, "cos"),
    ({"sin": torch.zeros(3, 16, dtype=torch.float64)}, "sin"),
    ({"page": torch.zeros(3, dtype=torch.int32)}, "page"),
    ({"q_norm": torch.zeros(8)}, "q_norm"),
    ({"kv": torch.zeros(7, 3, 2, 4, 2, 16, dtype=torch.float64)}, "pool's dtype"),
])
def test_bad_input_is_refused_by_name(bad: dict[str, Any], message: str) -> None:
    a = {**_inputs(3, 4, 2, 16, True, torch.float32, "cpu"), **bad}
    before = a["kv"].clone()
    with pytest.raises(ValueError, match=message):
        kw.rotary_kv_write(**a)
    assert torch.equal(a["kv"], before)  # (refused before anything is written)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_kernel_in_triton_interpreter() -> None:
    """The kernel on CPU tensors under TRITON_INTERPRET=1."""
    assert "checked" in run_in_triton_interpreter(__file__)


@requires_cuda
@pytest.mark.skipif(not kw.HAS_TRITON_OP, reason="needs triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_cuda(dtype: torch.dtype) -> None:
    _check_cases(dtype, "cuda", 1.6e-2)  # (two units in the last place)
    a = _inputs(1, 16, 8, 128, True, dtype, "cuda")  # (through the op, as the package calls it)
    ref_kv, got_kv = a["kv"].clone(), a["kv"].clone()
    got, ref = kw.rotary_kv_write(**{**a, "kv": got_kv}), kw.rotary_kv_write_reference(**{**a, "kv": ref_kv})
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(got_kv, ref_kv, rtol=tol, atol=tol)


@pytest.mark.skipif(not kw.HAS_TRITON_OP, reason="needs triton")
def test_decode_one_writes_the_pool_in_place_at_every_layer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """decode_one's trace compiled by AOTInductor: each layer's kernel
    writes the pool itself, none of them a copy of it (Inductor clones a
    mutated input it cannot reinplace: a whole pool a layer, each step).
    On a CPU the op is called in place of its reference and Triton's
    analysis of which arguments the kernel writes (which needs a GPU
    driver) is given its answer; the compile then stops at code generation,
    after the reinplacing pass this checks."""
    import logging

    import torch._higher_order_ops.triton_kernel_wrap as wrap
    from torch._dynamo.utils import ReinplaceCounters

    from aoti_sessions.llm.exporting import _one_row, _paged
    from aoti_sessions.llm.exporting._fused import fused_projections

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        monkeypatch.setattr(wrap, "get_mutated_tensors", lambda _k, _c, kwargs, _t: [n for n in ("KV", "Q") if n in kwargs])
        monkeypatch.setattr(_one_row, "rotary_kv_write", lambda *a: torch.ops.aoti_sessions.rotary_kv_write(*a))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_model_dir("qwen3"), local_files_only=True)
    model = model.to(device).eval()
    reports: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: reports.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("torch._inductor.fx_passes.reinplace")
    logger.addHandler(handler)
    monkeypatch.setattr(logger, "level", logging.INFO)
    ReinplaceCounters.clear()
    try:
        with torch.no_grad(), fused_projections(model), _paged.paged_attention_on(model):
            module = _paged.PagedLM(model, page_size=4, max_pages=4, kernel=device.type == "cuda")
            module.one_row = _one_row.plan_one_row(model)
            assert module.one_row.complete

            class One(torch.nn.Module):
                def __init__(self) -> None:
                    super().__init__()
                    self.m = module

                def forward(self, *args: torch.Tensor) -> torch.Tensor:
                    return self.m.decode_one(*args)  # type: ignore[no-any-return]

            args = (torch.tensor([[7]]), module.pool_example(64, torch.float32, device),
                    torch.tensor([[3, 1, 4, 0]], dtype=torch.int32), torch.tensor([6]))
            program = torch.export.export(One(), tuple(a.to(device) for a in args))
            try:
                torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "one.pt2"))
            except Exception as e:  # noqa: BLE001 - on a CPU, code generation needs the driver
                if device.type == "cuda" or "driver" not in str(e):
                    raise
    finally:
        logger.removeHandler(handler)
    writes = [r for r in reports if "_rotary_kv_kernel" in r]
    assert len(writes) == model.config.num_hidden_layers, reports
    assert all("missed opportunities=[]" in r and "'KV'" in r.split("successfully reinplaced=")[1].split("]")[0]
               for r in writes), writes
    assert ReinplaceCounters.get_total_missed() == 0


if __name__ == "__main__":  # the interpreter case, in a process of its own
    for dt in (torch.float32, torch.bfloat16):
        _check_cases(dt, "cpu", 4e-2)  # (the interpreter truncates float32 to bfloat16: a few units)
    print("checked")
