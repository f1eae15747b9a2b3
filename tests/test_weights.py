"""Weights held once: multi-method ais.compile packages (weights outside the
libraries), foreign packages with embedded weights (duplicates freed after
binding), same-FQN-different-content kept apart or refused, update_weights."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import aoti_sessions as ais
import modeldefs
from aoti_sessions.models import SMALL, TinyDecoder
from conftest import DECODER_PREFILL, FAST, PREFILL, counter_inputs


def _eager_bytes(module: torch.nn.Module, fqns: list[str]) -> int:
    named = dict(module.named_parameters()) | dict(module.named_buffers())
    return sum(named[f].untyped_storage().nbytes() if named[f].is_contiguous() else named[f].nbytes
               for f in fqns)


def _decode_both(engine: ais.Engine, device: str, prefill: str, decode: str, t: int) -> list[torch.Tensor]:
    """Prefill `t` tokens then decode three, in one session; returns every output."""
    toks = torch.arange(1, t + 1, device=device).view(1, t)
    outs = []
    with engine.new_session() as s:
        outs.append(s.run(prefill, toks, torch.arange(t, device=device)))
        for i in range(3):
            outs.append(s.run(decode, torch.tensor([[i + 2]], device=device), torch.tensor([t + i], device=device)))
    return outs


def _decode_eager(device: str, t: int) -> list[torch.Tensor]:
    model = TinyDecoder(SMALL).to(device).eval()
    toks = torch.arange(1, t + 1, device=device).view(1, t)
    with torch.no_grad():
        outs = [model(toks, torch.arange(t, device=device))]
        for i in range(3):
            outs.append(model(torch.tensor([[i + 2]], device=device), torch.tensor([t + i], device=device)))
    return outs


def test_two_method_package_holds_one_copy_and_matches_eager(decoder_methods_pkg: Path, device: str) -> None:
    with ais.Engine(decoder_methods_pkg, device=device) as engine:
        assert sorted(engine.methods) == ["decode", "prefill"]
        held = engine.weights()
        fqns = [w["fqn"] for w in held]
        assert len(fqns) == len(set(fqns)), "a weight is held twice"
        assert all(sorted(w["methods"]) == ["decode", "prefill"] for w in held)
        eager = TinyDecoder(SMALL)
        assert engine.weight_bytes == sum(w["bytes"] for w in held) == _eager_bytes(eager, fqns)
        report = engine.memory_report()["device" if device != "cpu" else "host"]
        assert report["weights"] == engine.weight_bytes
        assert report["containers"] == 0, "a container kept memory of its own"
        got = _decode_both(engine, device, "prefill", "decode", DECODER_PREFILL)
    for g, e in zip(got, _decode_eager(device, DECODER_PREFILL)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_three_methods_with_partly_shared_weights(heads_pkg: Path, device: str) -> None:
    eager = modeldefs.Heads().to(device)
    (idx,) = modeldefs.Heads.example()
    idx = idx.to(device)
    with ais.Engine(heads_pkg, device=device) as engine:
        by_fqn = {w["fqn"]: sorted(w["methods"]) for w in engine.weights()}
        assert by_fqn == {"emb": ["a", "b", "both"], "head_a": ["a", "both"], "head_b": ["b", "both"]}
        assert engine.weight_bytes == _eager_bytes(eager, list(by_fqn))
        with engine.new_session() as s, torch.no_grad():
            torch.testing.assert_close(s.run("a", idx), eager.a(idx))
            torch.testing.assert_close(s.run("b", idx), eager.b(idx))
            both = s.run("both", idx)
            torch.testing.assert_close(both[0], eager.a(idx))
            torch.testing.assert_close(both[1], eager.b(idx))


def test_foreign_packages_share_embedded_weights(decoder_pkg: Path, prefill_pkg: Path, device: str) -> None:
    with ais.Engine(decoder_pkg, device=device) as single:
        one_copy = single.weight_bytes
    with ais.Engine({"decode": decoder_pkg, "prefill": prefill_pkg}, device=device) as engine:
        assert engine.weight_bytes == one_copy
        assert all(sorted(w["methods"]) == ["decode", "prefill"] for w in engine.weights())
        got = _decode_both(engine, device, "prefill", "decode", PREFILL)
    for g, e in zip(got, _decode_eager(device, PREFILL)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_same_fqn_other_content_kept_apart_or_refused(counter_pkg: Path, counter_reseeded_pkg: Path, device: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    methods = {"one": counter_pkg, "other": counter_reseeded_pkg}
    with caplog.at_level(logging.WARNING, logger="aoti_sessions"):
        engine = ais.Engine(methods, device=device)
    with engine:
        assert "lin.weight" in caplog.text and "separate copy" in caplog.text
        variants = [w for w in engine.weights() if w["fqn"] == "lin.weight"]
        assert sorted(m for w in variants for m in w["methods"]) == ["one", "other"] and len(variants) == 2
        shared = [w for w in engine.weights() if w["fqn"] == "table"]
        assert len(shared) == 1 and sorted(shared[0]["methods"]) == ["one", "other"]
        x, slot = counter_inputs(device)
        with engine.new_session() as a, engine.new_session() as b, torch.no_grad():
            torch.testing.assert_close(a.run("one", x, slot), modeldefs.Counter().to(device)(x, slot))
            torch.testing.assert_close(b.run("other", x, slot), modeldefs.CounterReseeded().to(device)(x, slot))
    with pytest.raises(ais.PackageError, match="lin.weight.*strict"):
        ais.Engine(methods, device=device, strict_weights=True)


def _heads_outputs(engine: ais.Engine, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with engine.new_session() as s:
        return s.run("a", idx), s.run("b", idx)


@pytest.mark.parametrize("double_buffer", [False, True])
def test_update_weights_matches_eager_with_new_weights(heads_pkg: Path, device: str, double_buffer: bool) -> None:
    (idx,) = modeldefs.Heads.example()
    idx = idx.to(device)
    eager = modeldefs.Heads()
    new = {k: (v * -2 + 1).detach() for k, v in eager.state_dict().items()}
    if double_buffer:
        new = {k: v.pin_memory() if torch.cuda.is_available() else v for k, v in new.items()}
    with ais.Engine(heads_pkg, device=device) as engine, engine.new_session() as kept:
        kept.run("a", idx)
        engine.update_weights(new, double_buffer=double_buffer)
        eager.load_state_dict(new)
        eager.to(device)
        with torch.no_grad():
            a, b = _heads_outputs(engine, idx)
            torch.testing.assert_close(a, eager.a(idx))
            torch.testing.assert_close(b, eager.b(idx))
            torch.testing.assert_close(kept.run("both", idx)[0], eager.a(idx))  # an open session sees them too
        assert engine.weight_bytes == _eager_bytes(eager, ["emb", "head_a", "head_b"])


def test_bad_weight_updates_change_nothing(heads_pkg: Path, counter_engine: ais.Engine, device: str) -> None:
    (idx,) = modeldefs.Heads.example()
    idx = idx.to(device)
    good = {k: v.detach() * 3 for k, v in modeldefs.Heads().state_dict().items()}
    with ais.Engine(heads_pkg, device=device) as engine:
        before = _heads_outputs(engine, idx)
        cases: list[tuple[dict[str, torch.Tensor], type[Exception], str]] = [
            ({**good, "nope": torch.zeros(1)}, ValueError, "'nope' is not a weight"),
            ({**good, "emb": good["emb"].double()}, TypeError, "emb.*float32"),
            ({**good, "head_b": torch.zeros(8, 5)}, ValueError, "head_b"),
            ({**good, "head_a": good["head_a"].t().contiguous().t()}, ValueError, "strides"),
            ({**good, "emb": 3}, TypeError, "emb"),  # type: ignore[dict-item]
        ]
        if device != "cpu":
            cases.append(({**good, "emb": good["emb"].to(device)}, ValueError, "CPU tensor"))
        for update, error, message in cases:
            with pytest.raises(error, match=message):
                engine.update_weights(update)
            after = _heads_outputs(engine, idx)
            assert all(torch.equal(x, y) for x, y in zip(before, after)), f"{message}: weights changed"
    with pytest.raises(ValueError, match="per-session mutable state"):
        counter_engine.update_weights({"acc": torch.zeros(4, 8)})


@pytest.mark.parametrize("double_buffer", [False, True])
def test_runs_racing_an_update_see_old_or_new_never_a_mix(heads_pkg: Path, device: str, double_buffer: bool) -> None:
    (idx,) = modeldefs.Heads.example()
    idx = idx.to(device)
    eager = modeldefs.Heads()
    sets = [{k: v.detach().clone() for k, v in eager.state_dict().items()},
            {k: (v * -1.5).detach() for k, v in eager.state_dict().items()}]
    with ais.Engine(heads_pkg, device=device) as engine:
        expected = []
        for sd in sets:
            engine.update_weights(sd)
            expected.append(_heads_outputs(engine, idx)[0].cpu())
        assert not torch.equal(expected[0], expected[1])
        stop = threading.Event()
        seen: list[torch.Tensor] = []
        errors: list[BaseException] = []

        def runner() -> None:
            try:
                with engine.new_session() as s:
                    while not stop.is_set():
                        seen.append(s.run("both", idx)[0].cpu())  # reads emb and head_a
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=runner) for _ in range(2)]
        for t in threads:
            t.start()
        # At least 40 updates, and on until the runners have run often enough
        # in between (on two busy cores the updates can outpace them).
        i = 0
        deadline = time.monotonic() + 60
        while i < 40 or (len(seen) <= 20 and time.monotonic() < deadline):
            engine.update_weights(sets[i % 2], double_buffer=double_buffer)
            i += 1
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    assert len(seen) > 10
    mixed = [o for o in seen if not any(torch.equal(o, e) for e in expected)]
    assert not mixed, f"{len(mixed)} of {len(seen)} runs saw a mix of old and new weights"


def test_resident_memory_is_one_copy_for_two_methods(tmp_path: Path) -> None:
    """CPU: a model with 256 MiB of weights served by two methods costs one copy."""
    from conftest import _compiled_methods

    def build():
        x1, x4 = torch.randn(1, 8192), torch.randn(4, 8192)
        return modeldefs.Wide(), {"one": ((x1,),), "four": ((x4,),)}, None

    with torch.no_grad():
        pkg = _compiled_methods("wide", "cpu", build)
    weights = 8192 * 8192 * 4
    script = textwrap.dedent(f"""
        import gc, torch, aoti_sessions as ais

        def rss():
            gc.collect()
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096

        base = rss()
        engine = ais.Engine({str(pkg)!r})
        with engine.new_session() as s:
            s.run("one", torch.ones(1, 8192)); s.run("four", torch.ones(4, 8192))
        print(rss() - base, engine.weight_bytes)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    grown, held = (int(v) for v in out.stdout.split())
    assert held == weights
    assert weights <= grown < 1.25 * weights, f"RSS grew {grown / 2**20:.0f} MiB for {weights / 2**20:.0f} MiB of weights"
