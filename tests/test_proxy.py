"""Ops a compiled model runs through AOTInductor's proxy executor (custom
ops, fallback kernels): the engine runs them (aoti_sessions._proxy, the
core's ProxyExecutor) with per-session state, a failing op is a clean run
error, and a package whose op this process lacks is refused at load."""

from __future__ import annotations

import copy
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aoti_sessions as ais
import proxy_ops
from aoti_sessions import _package, _proxy
from aoti_sessions._compile import compile_cached
from aoti_sessions.errors import PackageError, RunError
from conftest import FAST

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def package(device: str) -> Path:
    dev = torch.device(device)

    def build():
        return proxy_ops.ProxyModel().to(dev), (torch.randn(3, 8, device=dev),), None

    return compile_cached(build, (inspect.getsource(proxy_ops), device), name=f"proxy-{device}",
                              inductor_configs=FAST)


def test_the_package_calls_its_op_through_the_proxy_executor(package: Path) -> None:
    files = _package.open_model(package)
    assert len(files) == 1
    assert _proxy.proxy_call(files[0].library, files[0].name, torch.device("cpu")) is not None
    assert _proxy.op_modules(package) == ["proxy_ops"] == files[0].op_modules  # recorded by ais.compile


def test_sessions_run_the_op_each_with_its_own_state(package: Path, device: str) -> None:
    model = proxy_ops.ProxyModel().to(device)
    with ais.Engine(package, device=device) as engine:
        a, b = engine.new_session(), engine.new_session()
        eager_a, eager_b = copy.deepcopy(model), copy.deepcopy(model)
        for step in range(3):
            x = torch.randn(3, 8, device=device)
            torch.testing.assert_close(a.run("model", x), eager_a(x))
            if step != 1:
                x2 = torch.randn(3, 8, device=device) * 2
                torch.testing.assert_close(b.run("model", x2), eager_b(x2))
        torch.testing.assert_close(a.state()["total"], eager_a.total)
        torch.testing.assert_close(b.state()["total"], eager_b.total)


def test_compile_verify_runs_the_op(tmp_path: Path) -> None:
    path = ais.compile(proxy_ops.ProxyModel(), (torch.randn(3, 8),), path=tmp_path / "p.pt2", verify=2,
                       inductor_configs=FAST, progress=None)
    assert Path(path).is_file()


def test_a_failing_op_is_a_run_error_that_leaves_the_engine(package: Path, device: str) -> None:
    model = proxy_ops.ProxyModel().to(device)
    with ais.Engine(package, device=device) as engine:
        s, other = engine.new_session(), engine.new_session()
        x = torch.randn(3, 8, device=device)
        s.run("model", x)
        with pytest.raises(RunError, match="beyond"):
            s.run("model", torch.full((3, 8), 1e9, device=device))
        torch.testing.assert_close(other.run("model", x), model(x))
        assert s.run("model", x).shape == (3, 8)


def _load_elsewhere(package: Path, device: str = "cpu", *, path: str = "", trust: object = False) -> str:
    """What loading ``package`` and running it prints in a fresh interpreter
    that has not imported proxy_ops (``path``: its PYTHONPATH; ``trust``:
    the engine's trust_op_modules)."""
    code = ("import torch, aoti_sessions as ais\n"
            "try:\n"
            f"    e = ais.Engine({str(package)!r}, device={device!r}, trust_op_modules={trust!r})\n"
            f"    print('ran:', e.new_session().run('model', torch.ones(3, 8, device={device!r})).shape)\n"
            "except ais.errors.PackageError as e:\n"
            "    print('refused:', e)\n")
    # The aoti_sessions under test, wherever it is imported from here.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [path, str(Path(ais.__file__).parent.parent)]))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                         cwd=HERE.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_the_ops_module_the_package_records_is_imported_at_load(package: Path, device: str) -> None:
    """Where the caller allows it (proxy_ops is no module of an installed
    package the engine trusts by default: tests/test_package_trust.py)."""
    assert "ran: torch.Size([3, 8])" in _load_elsewhere(package, device, path=str(HERE), trust=["proxy_ops"])
    refused = _load_elsewhere(package, device, trust=True)
    assert "refused:" in refused and "proxy_ops" in refused and "cannot be imported" in refused, refused


def test_a_package_whose_op_is_not_registered_is_refused_at_load(tmp_path: Path) -> None:
    """torch's own packaging records no op module: the op must be registered first."""
    exported = torch.export.export(proxy_ops.ProxyModel(), (torch.randn(3, 8),))
    package = torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp_path / "t.pt2"),
                                                       inductor_configs=FAST)
    out = _load_elsewhere(Path(package))
    assert "refused:" in out and proxy_ops.OP in out and "import the module" in out, out


def test_an_unreadable_description_is_refused(package: Path, tmp_path: Path) -> None:
    library = Path(_package.open_model(package)[0].library)
    copy_dir = tmp_path / "m"
    copy_dir.mkdir()
    (copy_dir / "x.json").write_text("{not json")
    with pytest.raises(PackageError, match="extern-kernel description"):
        _proxy.proxy_call(str(copy_dir / "x.so"), "model", torch.device("cpu"))
    assert library.with_suffix(".json").is_file()


def test_every_argument_kind_of_a_plan(tmp_path: Path) -> None:
    """Tensor lists in and out, an absent optional tensor, a symbolic int,
    keyword-only dtype and bool arguments: the engine calls the op as the
    eager module does, for batch sizes the export never saw."""
    batch = torch.export.Dim("batch", min=1, max=64)
    path = ais.compile(proxy_ops.MixModel(), (torch.randn(3, 4), torch.randn(3, 4)), path=tmp_path / "mix.pt2",
                       dynamic_shapes=({0: batch}, {0: batch}), inductor_configs=FAST, progress=None)
    with ais.Engine(path) as engine:
        s = engine.new_session()
        for rows in (2, 3, 7):
            a, b = torch.randn(rows, 4), torch.randn(rows, 4)
            torch.testing.assert_close(s.run("model", a, b), proxy_ops.MixModel()(a, b))


def test_a_plan_checks_the_counts_a_call_brings_and_its_op_returns() -> None:
    """A node's generated plan, from a description written here: it calls the
    op with each argument from its place, and a call or a result whose counts
    differ from the description is a RuntimeError naming the op."""
    from torch._export.serde.serialize import _TORCH_TO_SERIALIZE_DTYPE

    def node(outputs: int) -> dict[str, object]:
        return {"target": proxy_ops.MIX + ".default",
                "inputs": [{"name": "xs", "arg": {"as_tensors": [{"name": "a"}, {"name": "b"}]}},
                           {"name": "maybe", "arg": {"as_none": True}}, {"name": "n", "arg": {"as_int": 3}},
                           {"name": "dtype", "arg": {"as_scalar_type": _TORCH_TO_SERIALIZE_DTYPE[torch.float64].value}},
                           {"name": "flag", "arg": {"as_bool": True}}],
                "outputs": [{"as_tensors": [{"name": f"o{k}"} for k in range(outputs)]}]}

    plan = _proxy._node(node(2), "model", torch.device("cpu"), ())
    a, b = torch.randn(2, 4), torch.randn(2, 4)
    out = plan([3], [a, b, torch.empty(0), torch.empty(0)])
    assert [at for at, _ in out] == [2, 3]
    got = _proxy._steal([handle for _, handle in out])
    torch.testing.assert_close(got, proxy_ops.mix([a, b], None, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="mix.default: called with 2 ints and 4 tensors; its description takes 1 "
                                           "and 4"):
        plan([3, 4], [a, b, a, b])
    with pytest.raises(RuntimeError, match="mix.default returned 2 tensors where its description has 3"):
        _proxy._node(node(3), "model", torch.device("cpu"), ())([3], [a, b, a, b, a])
