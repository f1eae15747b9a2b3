"""The step loop's decisions (aoti_sessions.llm.runtime._plan) without an engine:
which generations decode, which prompt chunks are fed, how prefill rows
share calls and what width a call is padded to, with stand-ins for the
generations (the scheduler's own tests run them on an exported model)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from aoti_sessions.llm.runtime._plan import Limits, Row, plan_step, prefill_groups, prefill_width

LIMITS = Limits(budget=64, max_prefill=32, prefill_rows=4, max_context=256, min_bucket=16)


@dataclass
class Session:
    token_count: int = 0


@dataclass(eq=False)
class Gen:
    """What the plan reads of a generation."""

    _pending: list[int] = field(default_factory=list)
    goes_on: bool = True
    finished: bool = False
    _session: Session = field(default_factory=Session)

    def _feeds_next(self) -> bool:
        return self.goes_on


def prompt(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def test_the_rows_sampled_last_decode_from_the_device_in_the_active_order() -> None:
    a, b, c, done = Gen(), Gen(goes_on=False), Gen(), Gen(finished=True)
    plan = plan_step([c, a, b, done], [a, b, c, done], LIMITS)
    assert [(r.generation, r.fed, r.samples, r.from_device) for r in plan.decode] == [(c, [], True, 2),
                                                                                      (a, [], True, 0)]
    assert plan.prefill == []


def test_prompts_are_fed_first_come_first_served_up_to_the_budget() -> None:
    first, second, third = Gen(prompt(40)), Gen(prompt(20)), Gen(prompt(30))
    plan = plan_step([first, second, third], [], LIMITS)
    fed = {id(r.generation): r for group in plan.prefill for r in group}
    # 64 tokens: first's chunk stops at max_prefill, second's prompt is all fed, third gets the rest.
    assert fed[id(first)].fed == prompt(32) and not fed[id(first)].samples
    assert fed[id(second)].fed == prompt(20) and fed[id(second)].samples
    assert fed[id(third)].fed == prompt(12) and not fed[id(third)].samples
    assert plan.decode == []


def test_a_one_token_chunk_is_a_decode_row_and_samples_only_at_the_prompts_end() -> None:
    last, long = Gen(prompt(1, 7)), Gen(prompt(70))
    plan = plan_step([long, last], [], Limits(budget=33, max_prefill=32, prefill_rows=4, max_context=256))
    assert [(r.generation, r.fed, r.samples) for r in plan.decode] == [(last, [7], True)]
    leftover = plan_step([long], [], Limits(budget=1, max_prefill=32, prefill_rows=4, max_context=256))
    assert [(r.fed, r.samples) for r in leftover.decode] == [([1], False)] and leftover.prefill == []


def test_prefill_rows_share_a_call_while_their_padding_is_shorter_than_them() -> None:
    rows = [Row(Gen(), prompt(n), True) for n in (10, 30, 16, 15, 8, 31, 29)]
    groups = prefill_groups(rows, LIMITS)
    assert [[len(r.fed) for r in g] for g in groups] == [[31, 30, 29, 16], [15, 10, 8]]
    crowded = Row(Gen(_session=Session(230)), prompt(20), True)  # 230 + 31 > 256: not in the 31-wide call
    assert [[len(r.fed) for r in g] for g in prefill_groups([rows[5], crowded], LIMITS)] == [[31], [20]]


def test_a_call_is_padded_to_a_bucket_within_the_limits_and_the_context() -> None:
    def width(lengths: list[int], used: int = 0, buckets: bool = True, max_prefill: int = 64) -> int:
        limits = Limits(budget=256, max_prefill=max_prefill, prefill_rows=4, max_context=256, min_bucket=16)
        return prefill_width([Row(Gen(_session=Session(used)), prompt(n), True) for n in lengths], limits, buckets)

    assert width([5, 3], buckets=False) == 5
    assert width([5, 3]) == 16 and width([17]) == 32 and width([33, 2]) == 64
    assert width([33], max_prefill=48) == 48  # the bucket beyond max_prefill: max_prefill
    assert width([20], used=230) == 26  # no room for 32 positions: the context's end
    assert width([30], used=240) == 30  # (never shorter than the longest chunk)


def test_random_plans_keep_their_rules() -> None:
    rng = random.Random(35)
    for _ in range(500):
        limits = Limits(budget=rng.randint(1, 96), max_prefill=rng.randint(2, 48), prefill_rows=rng.randint(1, 6),
                        max_context=256, min_bucket=16)
        gens = [Gen(prompt(rng.choice([0, 0, 1, 2, rng.randint(3, 80)])), goes_on=rng.random() < 0.8,
                    finished=rng.random() < 0.1, _session=Session(rng.randint(0, 150)))
                for _ in range(rng.randint(0, 12))]
        sampled = [g for g in gens if not g._pending and rng.random() < 0.7]
        rng.shuffle(sampled)
        plan = plan_step(gens, sampled, limits)
        rows = plan.decode + [r for group in plan.prefill for r in group]
        assert len({id(r.generation) for r in rows}) == len(rows)  # a generation once a step
        assert all(not r.generation.finished for r in rows)
        assert sum(len(r.fed) for r in rows) <= limits.budget
        for r in rows:
            g = r.generation
            if r.from_device >= 0:
                assert sampled[r.from_device] is g and g.goes_on and r.fed == [] and r.samples
            else:
                assert g not in sampled and r.fed == g._pending[:len(r.fed)] and 1 <= len(r.fed) <= limits.max_prefill
                assert r.samples == (len(r.fed) == len(g._pending))
        assert all(len(r.fed) <= 1 for r in plan.decode)
        assert all(len(r.fed) >= 2 for group in plan.prefill for r in group)
        assert all(1 <= len(group) <= limits.prefill_rows for group in plan.prefill)
        # First come, first served: a generation with a prompt is left out only once the budget is spent.
        fed = {id(r.generation) for r in rows if r.from_device < 0}
        waiting = [g for g in gens if g._pending and not g.finished and g not in sampled]
        for i, g in enumerate(waiting):
            if id(g) not in fed:
                spent = sum(len(r.fed) for r in rows if r.from_device < 0 and r.generation in waiting[:i])
                assert spent >= limits.budget
        for group in plan.prefill:
            width = prefill_width(group, limits, buckets=True)
            assert width >= max(len(r.fed) for r in group)
