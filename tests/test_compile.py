"""ais.compile: strict or not, verify=, progress, call signatures (recorded,
shown by `info`, positional calls to keyword inputs), the order of methods, and
the one-element buffers AOTInductor folds into constants."""

from __future__ import annotations

import inspect
import io
import logging
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn
from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

import aoti_sessions as ais
import modeldefs
from aoti_sessions._compile import compile_cached
from aoti_sessions._package import open_model
from aoti_sessions._program import Method, export
from aoti_sessions._verify import verify_package
from aoti_sessions.demo import quiet_torch
from conftest import FAST, _compiled
from test_package import _with_metadata

# Dynamo's note on transformers' output-capture global, raised by every strict export of its models.
SIDE_EFFECTS = "ignore:While compiling, we found certain side effects:UserWarning"
CACHE_LEN = 32
PREFILL = 4  # example prompt length of the two-method package


def static_cache_lm(arch: str, device: str = "cpu") -> nn.Module:
    """transformers' static-cache export wrapper around a random-weight tiny
    decoder (the same weights every call). The cache is made on `device`
    (moving the wrapper later would leave the cache's own references behind)."""
    torch.manual_seed(0)
    config = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, head_dim=16)
    if arch == "qwen3":
        model: nn.Module = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    model.to(device).eval()
    model.generation_config = transformers.GenerationConfig(
        use_cache=True, cache_implementation="static", max_length=CACHE_LEN,
        cache_config={"batch_size": 1, "max_cache_len": CACHE_LEN})
    return TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=CACHE_LEN,
                                                device=torch.device(device))


def decode_inputs(position: int = 0) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.tensor([[position + 1]]), "cache_position": torch.tensor([position])}


def lm_methods() -> dict[str, Method]:
    """Prefill (dynamic length, given first) then decode, both by keyword."""
    tokens = torch.export.Dim("tokens", min=2, max=16)
    return {
        "prefill": Method((), {"input_ids": torch.arange(1, PREFILL + 1)[None],
                               "cache_position": torch.arange(PREFILL)},
                          dynamic_shapes={"input_ids": {1: tokens}, "cache_position": {0: tokens}}),
        "decode": Method((), decode_inputs(PREFILL)),
    }


def _cached(name: str, build, configs=FAST) -> Path:
    key = (inspect.getsource(static_cache_lm), inspect.getsource(lm_methods), inspect.getsource(build),
           transformers.__version__, "signatures-v1")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="While compiling, we found certain side effects")
        return compile_cached(build, key, name=name, inductor_configs=configs, progress=None)


@pytest.fixture(scope="module")
def lm_pkg() -> Path:
    """The static-cache wrapper compiled with ais.compile's defaults (strict=None)."""
    return _cached("static-cache-qwen3", lambda: (static_cache_lm("qwen3"), (), decode_inputs()))


@pytest.fixture(scope="module")
def lm_methods_pkg() -> Path:
    return _cached("static-cache-qwen3-methods", lambda: (static_cache_lm("qwen3"), lm_methods(), None))


class Counters(nn.Module):
    """Step counters of one element (`step`, `count`) beside a running sum: the
    counters are updated from themselves and constants only."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        self.register_buffer("count", torch.zeros(1))
        self.register_buffer("acc", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.step += 1
        self.count.add_(1)
        self.acc.add_(x)
        return x * self.count + self.step, self.acc.clone()


class Tally(nn.Module):
    """Two entry points over one state; `tick` counts its calls in one element."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(4))
        self.register_buffer("ticks", torch.zeros((), dtype=torch.int64))

    def add(self, x: torch.Tensor) -> torch.Tensor:
        self.acc.add_(x)
        return self.acc * 2

    def tick(self, x: torch.Tensor) -> torch.Tensor:
        self.ticks += 1
        return self.acc.sum() + x + self.ticks


# -- strict ---------------------------------------------------------------

@pytest.mark.filterwarnings(SIDE_EFFECTS)
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_static_cache_exports_with_the_defaults(arch: str, caplog: pytest.LogCaptureFixture) -> None:
    """torch's non-strict trace lifts transformers' cache tensors twice (buffers
    and constants) and then fails to decompose; the default exports strictly
    instead, with one note, and an explicit strict=False says what to pass."""
    module = static_cache_lm(arch)
    method = Method((), decode_inputs())
    with caplog.at_level(logging.WARNING, logger="aoti_sessions"):
        exported = export(module, "forward", method, None)
    assert exported.strict
    assert "key_cache_0" in exported.mutated and "value_cache_1" in exported.mutated
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "exporting it again with strict=True" in notes[0] and "key_cache_0" in notes[0]
    with pytest.raises(ais.CompileError, match="pass strict=True"):
        export(module, "forward", method, False)


def test_compiled_static_cache_runs_positionally(lm_pkg: Path) -> None:
    """The package compiled with the defaults matches the module, and its
    keyword inputs can be given by position, in their exported order."""
    verify_package(static_cache_lm("qwen3"), str(lm_pkg), [("forward", Method((), decode_inputs()))], 3)
    with ais.Engine(lm_pkg) as engine, engine.new_session() as s, torch.no_grad():
        ids, pos = decode_inputs(0).values()
        by_keyword = s(input_ids=ids, cache_position=pos)
        assert torch.equal(s(ids, pos), by_keyword)
        assert torch.equal(s(ids, cache_position=pos), by_keyword)
        with pytest.raises(TypeError, match="takes 2 inputs .input_ids, cache_position by keyword or by "
                                            "position in this order., got 3 by position"):
            s(ids, pos, pos)
        with pytest.raises(TypeError, match="input 'input_ids' given by position and by keyword"):
            s(ids, input_ids=ids)
        with pytest.raises(TypeError, match="is missing input 'cache_position'"):
            s(ids)
        with pytest.raises(TypeError, match="unexpected keyword input 'position'"):
            s(ids, position=pos)


def test_positional_and_keyword_inputs_together() -> None:
    """A positional input then keywords: positions beyond the positional ones
    fill the keywords in their exported order."""
    package = _compiled(modeldefs.KwargsModel, "cpu")
    (x,), kw = modeldefs.KwargsModel.example()
    with ais.Engine(package) as engine:
        first, second = engine.new_session(), engine.new_session()
        for _ in range(2):
            ours = first(x, kw["gain"], kw["shift"])
            want = second(x, **kw)
            assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(ours),
                                                        torch.utils._pytree.tree_leaves(want)))


def test_keywords_for_positional_inputs_name_them(counter_cpu_pkg: Path) -> None:
    with ais.Engine(counter_cpu_pkg) as engine, engine.new_session() as s:
        with pytest.raises(TypeError, match=r"unexpected keyword inputs 'x', 'slot'; "
                                            r"it takes 2 positional inputs \(x, slot\)"):
            s(x=torch.randn(1, 8), slot=torch.tensor([0]))


# -- verify and the one-element buffers -----------------------------------

def test_verify_catches_one_element_counters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """AOTInductor reads a one-element buffer updated from constants as its
    initial value: the compile warns, and verify= fails at the second step
    naming both counters (not the running sum) and the output they feed."""
    module = Counters()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(ais.VerifyError) as failure:
            ais.compile(module, (torch.ones(4),), path=tmp_path / "c.pt2", inductor_configs=FAST, verify=3,
                        progress=None)
    error = failure.value
    assert (error.method, error.step, error.buffers, error.outputs) == ("forward", 2, ["step", "count"], [0])
    assert "buffer 'step': compiled 1, eager 2" in str(error)
    assert "joint_graph_constant_folding" in str(error)
    warned = [w for w in seen if issubclass(w.category, ais.CompileWarning)]
    assert len(warned) == 1 and "'step', 'count'" in str(warned[0].message)
    assert warned[0].filename == __file__  # points at the caller's ais.compile line
    assert not [w for w in seen if "LeafSpec" in str(w.message)]  # torch's own deprecation noise is hidden
    assert int(module.step) == 0 and float(module.count) == 0 and not module.acc.any()  # the module is untouched
    assert "ais.compile" not in capsys.readouterr().err  # progress=None is silent


def test_folding_off_keeps_counters() -> None:
    """With the option the warning names, the counters accumulate."""
    package = compile_cached(lambda: (Counters(), (torch.ones(4),), None), (inspect.getsource(Counters),),
                             name="counters-unfolded", inductor_configs={**FAST, "joint_graph_constant_folding": False},
                             progress=None)
    verify_package(Counters(), str(package), [("forward", Method((torch.ones(4),)))], 4)
    with ais.Engine(package) as engine, engine.new_session() as s:
        for _ in range(3):
            s(torch.ones(4))
        assert int(s.state()["step"]) == 3


def test_counter_warning_is_precise() -> None:
    """Only a one-element buffer that reads its own value and no input is
    folded: counters fed by an input, set without reading themselves, or of
    more elements compile right and are not warned about."""
    from aoti_sessions._program import warn_folded_counters

    class Fine(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("fed", torch.zeros(1))
            self.register_buffer("flag", torch.zeros(()))
            self.register_buffer("pair", torch.zeros(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.fed.add_(x.sum())
            self.flag.fill_(1)
            self.pair.add_(1)
            return x + self.fed + self.flag + self.pair.sum()

    fine = export(Fine(), "forward", Method((torch.ones(2),)), None)
    counters = export(Counters(), "forward", Method((torch.ones(4),)), None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ais.CompileWarning)
        assert warn_folded_counters(fine, "forward", {}) == []
        assert warn_folded_counters(counters, "forward", {"joint_graph_constant_folding": False}) == []
    with pytest.warns(ais.CompileWarning):
        assert warn_folded_counters(counters, "forward", {}) == ["step", "count"]


def test_verify_of_several_methods_runs_them_in_order(tmp_path: Path) -> None:
    """Each step runs the methods in the order given on one session; the
    failure names the method and step; progress is reported per method; the
    engine lists the methods in the order given; the module is untouched."""
    module = Tally()
    x = torch.ones(4)
    progress = io.StringIO()
    path = tmp_path / "tally.pt2"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(ais.VerifyError) as failure:
            ais.compile(module, {"tick": Method((x,), entry="tick"), "add": Method((x,), entry="add")}, path=path,
                        inductor_configs=FAST, verify=True, progress=progress)
    assert (failure.value.method, failure.value.step, failure.value.buffers) == ("tick", 2, ["ticks"])
    assert "each step runs tick then add on one session" in str(failure.value)
    assert any(issubclass(w.category, ais.CompileWarning) and "'ticks'" in str(w.message) for w in seen)
    assert int(module.ticks) == 0 and not module.acc.any()
    report = progress.getvalue()
    for line in ("ais.compile: exporting method 'tick' (1/2) done in", "ais.compile: compiling method 'add' (2/2) "
                 "with AOTInductor done in", "ais.compile: verifying tick, add against the module, 3 steps failed"):
        assert line in report, report
    with ais.Engine(path) as engine:
        assert engine.methods == ("tick", "add")
        assert engine.signature("add") == "add(x: float32[4], /) -> float32[4]"


@pytest.mark.filterwarnings(SIDE_EFFECTS)
def test_verify_passes_for_prefill_then_decode(lm_methods_pkg: Path) -> None:
    """The two-method package (dynamic prefill, decode), verified state and
    all over its steps; the methods keep the order given."""
    methods = list(lm_methods().items())
    verify_package(static_cache_lm("qwen3"), str(lm_methods_pkg), methods, 3)
    with ais.Engine(lm_methods_pkg) as engine:
        assert engine.methods == ("prefill", "decode")
        assert all(b["methods"] == ["prefill", "decode"] for b in engine.buffers())


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(1, -1, 3, 2, 16).permute(2, 0, 3, 1, 4)
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_attention_backend_per_method(tmp_path: Path) -> None:
    """Method(attention=...) picks the attention backends one method compiles
    to (read from the generated code), other methods keep torch's choice, and
    both compute the same attention."""
    from torch.nn.attention import SDPBackend

    x = torch.randn(1, 8, 32)
    path = tmp_path / "attention.pt2"
    ais.compile(SelfAttention(), {"fused": Method((x,)), "math": Method((x,), attention=[SDPBackend.MATH])},
                path=path, inductor_configs=FAST, progress=None)
    with zipfile.ZipFile(path) as z:
        code = {n.split("/")[-2]: z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp")}
    assert "flash_attention_for_cpu" in code["fused"]
    assert "scaled_dot_product" in code["math"] and "flash_attention" not in code["math"]
    with ais.Engine(path) as engine, engine.new_session() as s:
        torch.testing.assert_close(s.run("math", x), s.run("fused", x))
        torch.testing.assert_close(s.run("math", x), SelfAttention()(x))
    with pytest.raises(TypeError, match="attention must be a non-empty sequence of torch.nn.attention.SDPBackend"):
        Method((x,), attention=["math"])  # type: ignore[list-item]


def test_verify_argument_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="verify must be a number of steps >= 0"):
        ais.compile(Counters(), (torch.ones(4),), path=tmp_path / "x.pt2", verify=-1)
    with pytest.raises(TypeError, match="verify must be a bool or a number of steps"):
        ais.compile(Counters(), (torch.ones(4),), path=tmp_path / "x.pt2", verify="yes")  # type: ignore[arg-type]


# -- signatures -----------------------------------------------------------

def test_info_prints_each_signature(lm_methods_pkg: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "aoti_sessions", "info", str(lm_methods_pkg)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [line.strip() for line in result.stdout.splitlines()]
    prefill = next(line for line in lines if line.startswith("prefill("))
    symbol = prefill.split("input_ids: int64[1, ")[1].split("]")[0]
    assert symbol.startswith("s")  # the dynamic length, by its symbol, the same in every place
    assert prefill == (f"prefill(input_ids: int64[1, {symbol}], cache_position: int64[{symbol}]) "
                       f"-> float32[1, {symbol}, 128]  where 2 <= {symbol} <= 16")
    assert lines.index(prefill) + 1 == lines.index(
        "decode(input_ids: int64[1, 1], cache_position: int64[1]) -> float32[1, 1, 128]")


def test_signature_without_recorded_names(counter_cpu_pkg: Path, tmp_path: Path) -> None:
    """Packages that record no names show the inputs' positions; foreign ones
    (no metadata) no dtypes either."""
    def unnamed(doc):
        for entry in doc["inputs"]:
            entry.pop("name", None)
        doc.pop("outputs", None)
        return doc

    with ais.Engine(_with_metadata(counter_cpu_pkg, tmp_path / "unnamed.pt2", unnamed)) as engine:
        assert engine.signature() == "model(#0: float32[1, 8], #1: int64[1], /) -> Tensor"
    with ais.Engine(open_model(counter_cpu_pkg)[0].library) as engine:
        assert engine.signature() == "forward(#0: Tensor, #1: Tensor, /) -> Tensor"


def test_signature_of_nested_outputs_and_keywords() -> None:
    with ais.Engine(_compiled(modeldefs.KwargsModel, "cpu")) as engine:
        text = engine.signature()
    assert text == ("model(x: float32[2, 3], /, gain: float32[3], shift: float32[2, 3]) "
                    "-> (float32[2, 3], (float32[2, 3], float32[3]))")


# -- the demo's output ----------------------------------------------------

def test_demo_hides_torch_noise_only() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_torch():
            warnings.warn_explicit("deprecated inside torch", FutureWarning, "_pytree.py", 1,
                                   module="torch.utils._pytree")
            warnings.warn_explicit("raised for torch by copyreg", FutureWarning, "copyreg.py", 1, module="copyreg")
            warnings.warn_explicit("a compiler hint", UserWarning, "output_graph.py", 1,
                                   module="torch._dynamo.output_graph")
            warnings.warn_explicit("ours", ais.CompileWarning, "_program.py", 1, module="aoti_sessions._program")
    assert [str(w.message) for w in seen] == ["ours"]


class _SlicedViewRead(torch.nn.Module):
    """Views a slice of an activation; writes only its input in place."""

    def forward(self, x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        y = x * 2
        v = y[..., :4].view(2, 2, 2)
        buf.index_put_((torch.tensor([0]),), v.sum().reshape(1))
        buf[1:].add_(1)
        return v * 3


class _SlicedViewWritten(torch.nn.Module):
    """Writes an activation through a view of its slice."""

    def forward(self, x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        y = x * 2
        y[..., :4].view(2, 2, 2).add_(1)
        return y


@pytest.mark.parametrize("module, copied", [(_SlicedViewRead, 1), (_SlicedViewWritten, 0)])
def test_pooled_views_of_slices_read_copies_only_where_nothing_writes_through_them(module: type, copied: int) -> None:
    """A pooled method's view of a sliced activation reads a contiguous copy
    (Inductor would otherwise compile it for two rows at least: Phi-3), unless
    the program writes in place to anything but its inputs; either way the
    program computes what the module does."""
    from aoti_sessions._program import _copy_sliced_view_sources

    program = torch.export.export(module(), (torch.randn(2, 8), torch.zeros(3)))
    _copy_sliced_view_sources(program)
    clones = [n for n in program.graph.nodes if n.target is torch.ops.aten.clone.default]
    assert len(clones) == copied
    x = torch.randn(2, 8)
    ours, theirs = torch.zeros(3), torch.zeros(3)
    torch.testing.assert_close(program.module()(x, ours), module()(x, theirs))
    torch.testing.assert_close(ours, theirs)
