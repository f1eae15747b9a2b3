"""Sessions never see each other's state: interleaving, fork, reset, state."""

from __future__ import annotations

import torch

import aoti_sessions as ais
from aoti_sessions.demo import GreedyDecoding
from aoti_sessions.models import SMALL
from conftest import counter_inputs

PROMPTS = [[5, 9, 2], [200, 3, 77], [14, 14, 14], [1, 250, 128]]
STEPS = 12


def _solo(engine: ais.Engine, prompt: list[int], steps: int = STEPS) -> GreedyDecoding:
    with engine.new_session() as s:
        d = GreedyDecoding(s, prompt, steps)
        d.run()
    return d


def test_interleaved_sessions_equal_solo_runs(decoder_engine: ais.Engine) -> None:
    sessions = [decoder_engine.new_session() for _ in PROMPTS]
    runs = [GreedyDecoding(s, p, STEPS) for s, p in zip(sessions, PROMPTS)]
    while not runs[0].done:
        for r in runs:
            r.step()
    states = [s.state() for s in sessions]
    for s in sessions:
        s.close()
    generated = [r.generated for r in runs]
    assert len({tuple(g) for g in generated}) == len(PROMPTS), "prompts should decode differently"
    for prompt, got, state in zip(PROMPTS, generated, states):
        with decoder_engine.new_session() as s:
            solo = GreedyDecoding(s, prompt, STEPS)
            solo.run()
            assert solo.generated == got
            # Bit for bit: the whole KV cache, not only the argmax tokens.
            for fqn, value in s.state().items():
                assert torch.equal(value, state[fqn]), fqn


def test_interleaved_outputs_bitwise(counter_engine: ais.Engine, device: str) -> None:
    torch.manual_seed(7)
    inputs = [[counter_inputs(device, slot=k % 4) for k in range(10)] for _ in range(3)]
    sessions = [counter_engine.new_session() for _ in inputs]
    interleaved: list[list[torch.Tensor]] = [[] for _ in inputs]
    for step in range(10):
        for i, s in enumerate(sessions):
            interleaved[i].append(s(*inputs[i][step]))
    for i, seq in enumerate(inputs):
        with counter_engine.new_session() as s:
            for step, args in enumerate(seq):
                assert torch.equal(s(*args), interleaved[i][step])


def test_fork_continues_like_the_original(decoder_engine: ais.Engine, device: str) -> None:
    prompt = [7, 8, 9, 10]
    with decoder_engine.new_session() as original:
        head = GreedyDecoding(original, prompt, 4)
        head.run()
        fork = original.fork()
        assert fork.id != original.id
        for fqn, value in original.state().items():
            assert torch.equal(fork.state()[fqn], value)
        # Both continue from the same point; the fork must match what the original does.
        start = head.total
        token = head.token
        outs = {}
        for name, s in (("original", original), ("fork", fork)):
            t, seq = token, []
            for pos in range(start, start + 6):
                t = int(s(torch.tensor([[t]], device=device), torch.tensor([pos], device=device))[0, -1].argmax())
                seq.append(t)
            outs[name] = seq
        assert outs["fork"] == outs["original"]
        # And the continuation equals an uninterrupted solo run of the same length.
        assert head.generated + outs["original"] == _solo(decoder_engine, prompt, 4 + 6).generated
        fork.close()


def test_fork_is_independent(counter_engine: ais.Engine, device: str) -> None:
    x, slot = counter_inputs(device)
    with counter_engine.new_session() as a:
        a(x, slot)
        b = a.fork()
        b(x, slot)
        b(x, slot)
        assert int(a.state()["hits"].sum()) == 1
        assert int(b.state()["hits"].sum()) == 3
        b.close()


def test_reset_equals_fresh_session(decoder_engine: ais.Engine) -> None:
    prompt = [42, 43, 44]
    fresh = _solo(decoder_engine, prompt)
    with decoder_engine.new_session() as s:
        GreedyDecoding(s, [1, 2, 3, 4, 5], 10).run()
        s.reset()
        with decoder_engine.new_session() as clean:
            for fqn, value in clean.state().items():
                assert torch.equal(s.state()[fqn], value)
        again = GreedyDecoding(s, prompt, STEPS)
        again.run()
    assert again.generated == fresh.generated


def test_reset_restores_nonzero_template(counter_engine: ais.Engine, device: str) -> None:
    with counter_engine.new_session() as s:
        initial = s.state()
        s(*counter_inputs(device))
        assert not torch.equal(s.state()["acc"], initial["acc"])
        s.reset()
        assert all(torch.equal(s.state()[k], v) for k, v in initial.items())
        assert float(initial["acc"][0, 0]) == 0.5


def test_state_round_trip_moves_a_conversation(decoder_engine: ais.Engine, device: str) -> None:
    prompt = [11, 22, 33]
    with decoder_engine.new_session() as a, decoder_engine.new_session() as b:
        head = GreedyDecoding(a, prompt, 3)
        head.run()
        b.load_state(a.state())
        for fqn, value in a.state().items():
            assert torch.equal(b.state()[fqn], value)
        x, p = torch.tensor([[head.token]], device=device), torch.tensor([head.total], device=device)
        assert torch.equal(a(x, p), b(x, p))


def test_state_is_a_copy(counter_engine: ais.Engine) -> None:
    with counter_engine.new_session() as s:
        state = s.state()
        state["acc"].fill_(123.0)  # changing the copy must not touch the session
        assert float(s.state()["acc"][0, 0]) == 0.5


def test_load_state_accepts_other_strides_and_devices(counter_engine: ais.Engine) -> None:
    with counter_engine.new_session() as s:
        acc = torch.arange(32, dtype=torch.float32).reshape(8, 4).t()  # [4, 8], not contiguous, on the host
        s.load_state({"acc": acc, "hits": torch.tensor([1, 2, 3, 4])})
        assert torch.equal(s.state()["acc"].cpu(), acc)
        assert s.state()["acc"].is_contiguous()


def test_sessions_share_weights_not_state(decoder_engine: ais.Engine) -> None:
    before = decoder_engine.stats()["live_bytes"]
    sessions = [decoder_engine.new_session() for _ in range(3)]
    assert decoder_engine.stats()["live_bytes"] - before == 3 * SMALL.state_bytes
    for s in sessions:
        s.close()
    assert decoder_engine.stats()["live_bytes"] == before
