"""Loading, descriptors, and outputs against torch's own loader and eager."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_leaves

import aoti_sessions as ais
import modeldefs
from aoti_sessions.models import SMALL
from conftest import PREFILL, counter_inputs


def test_counter_descriptors(counter_engine: ais.Engine, counter_pkg, device: str) -> None:
    eng = counter_engine
    assert eng.methods == ("model",)
    assert eng.device.type == device
    # Exactly the mutated buffers (from ais.compile's metadata); `table` is read-only.
    assert sorted(eng.mutable_fqns) == ["acc", "hits"]
    buffers = {b["fqn"]: b for b in eng.buffers()}
    assert buffers["acc"]["dtype"] == "float32" and buffers["acc"]["sizes"] == [4, 8]
    assert buffers["hits"]["dtype"] == "int64" and buffers["hits"]["sizes"] == [4]
    assert buffers["acc"]["zero_initial"] is False and buffers["hits"]["zero_initial"] is True
    # The zero buffer costs no template bytes; each buffer is 256-byte aligned.
    assert eng.template_bytes == 256
    assert eng.bytes_per_session == 512
    # Every other constant the compiled model holds (inductor may inline tiny ones).
    held = torch._inductor.aoti_load_package(str(counter_pkg)).get_constant_fqns()
    state = modeldefs.Counter().state_dict()
    assert "table" in held and "lin.weight" in held
    assert eng.weight_bytes == sum(state[f].nbytes for f in held if f not in ("acc", "hits"))


def test_initial_state_is_the_modules(counter_engine: ais.Engine, device: str) -> None:
    module = modeldefs.Counter()
    with counter_engine.new_session() as s:
        state = s.state()
    assert state["acc"].device == counter_engine.device
    assert torch.equal(state["acc"].cpu(), module.acc)
    assert torch.equal(state["hits"].cpu(), module.hits)


def test_counter_matches_torch_loader_and_eager(counter_engine: ais.Engine, counter_pkg, device: str) -> None:
    reference = torch._inductor.aoti_load_package(str(counter_pkg))
    eager = modeldefs.Counter().to(device)
    with counter_engine.new_session() as s:
        for step in range(12):
            x, slot = counter_inputs(device, slot=step % 4)
            ours = s(x, slot)
            assert torch.equal(ours, reference(x, slot)), f"step {step}"
            torch.testing.assert_close(ours, eager(x, slot), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s.state()["acc"], eager.acc, rtol=1e-5, atol=1e-5)
        assert torch.equal(s.state()["hits"], eager.hits)


def test_kwargs_and_tuple_outputs(kwargs_pkg, device: str) -> None:
    reference = torch._inductor.aoti_load_package(str(kwargs_pkg))
    eager = modeldefs.KwargsModel().to(device)
    with ais.Engine(kwargs_pkg, device=device) as eng, eng.new_session() as s:
        assert eng.mutable_fqns == ("state",)
        for _ in range(3):
            (x,), kw = modeldefs.KwargsModel.example()
            x = x.to(device)
            kw = {k: v.to(device) for k, v in kw.items()}
            ours = s(x, shift=kw["shift"], gain=kw["gain"])  # keyword order does not matter
            theirs = reference(x, **kw)
            want = eager(x, **kw)
            assert isinstance(ours, tuple) and isinstance(ours[1], tuple)
            for a, b, c in zip(tree_leaves(ours), tree_leaves(theirs), tree_leaves(want)):
                assert torch.equal(a, b)
                torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
        with pytest.raises(TypeError, match="missing input .shift."):
            s(x, gain=kw["gain"])


def test_decoder_matches_eager(decoder_engine: ais.Engine, eager_decoder, device: str) -> None:
    assert len(decoder_engine.mutable_fqns) == 2 * SMALL.layers
    assert not any("rope" in f for f in decoder_engine.mutable_fqns)
    assert decoder_engine.bytes_per_session == SMALL.state_bytes
    with decoder_engine.new_session() as s, torch.no_grad():
        for pos, token in enumerate([3, 17, 42, 99, 5, 250]):
            x, p = torch.tensor([[token]], device=device), torch.tensor([pos], device=device)
            torch.testing.assert_close(s(x, p), eager_decoder(x, p), rtol=1e-4, atol=1e-4)


def test_prefill_then_decode_across_methods(prefill_pkg, decoder_pkg, eager_decoder, device: str) -> None:
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, SMALL.vocab, (1, PREFILL), generator=generator).to(device)
    positions = torch.arange(PREFILL, device=device)
    with ais.Engine({"prefill": prefill_pkg, "decode": decoder_pkg}, device=device) as eng, torch.no_grad():
        assert eng.methods == ("prefill", "decode")
        for b in eng.buffers():
            assert b["methods"] == ["prefill", "decode"]
        with eng.new_session() as s:
            ours = [s.run("prefill", prompt, positions)]
            want = [eager_decoder(prompt, positions)]
            token = int(ours[0][0, -1].argmax())
            for pos in range(PREFILL, PREFILL + 6):
                x, p = torch.tensor([[token]], device=device), torch.tensor([pos], device=device)
                ours.append(s.run("decode", x, p))
                want.append(eager_decoder(x, p))
                token = int(ours[-1][0, -1].argmax())
            for a, b in zip(ours, want):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        # Single-method call syntax is refused on a two-method engine.
        with eng.new_session() as s, pytest.raises(TypeError, match="2 methods \\(prefill, decode\\)"):
            s(torch.tensor([[1]], device=device), torch.tensor([0], device=device))


def test_engine_reports_stats(counter_engine: ais.Engine, device: str) -> None:
    a, b = counter_engine.new_session(), counter_engine.new_session()
    x, slot = counter_inputs(device)
    for s in (a, a, b, a):
        s(x, slot)
    st = counter_engine.stats()
    assert st["live_sessions"] == 2 and st["live_bytes"] == 2 * counter_engine.bytes_per_session
    assert st["runs"] == 4
    # a and b get a lane (container) each: only their first runs bind.
    assert st["binds"] == 2 and st["lanes"] >= 2
    a.close()
    b.close()
    assert counter_engine.stats()["live_sessions"] == 0
