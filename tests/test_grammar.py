"""Structured output (aoti_sessions.llm.runtime._grammar): generations held to a JSON
schema, any JSON object, a regex or a Lark grammar by token masks in the
batched sampler, on an exported random-weight tiny Qwen3: every text
matches its constraint, constrained and free rows share steps without
touching each other, and bad constraints are refused cleanly."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from aoti_sessions.llm import LLM, Constraint, SamplingParams
from conftest import requires_cuda
from llm_models import llm_package

CONTEXT = 128
# Bounded schemas: a random-weight model's strings and arrays would otherwise
# run to max_tokens (the text then fits the grammar so far, but is cut).
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "color": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                               "maxItems": 3}},
     "required": ["ok", "color", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}, "label": {"type": ["string", "null"], "maxLength": 6}},
     "required": ["point", "label"], "additionalProperties": False},
]


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=requires_cuda)])
def llm(request: pytest.FixtureRequest):
    with LLM(llm_package("qwen3", device=request.param, max_cache_len=CONTEXT), device=request.param,
             max_sessions=64) as m:
        yield m


def run(llm: LLM, prompt: str, params: SamplingParams) -> tuple[str, str, list[int]]:
    with llm.new_session() as s:
        out = s.generate(llm.encode(prompt), params)
    return out.text, out.finish_reason, out.token_ids


def test_every_generation_of_a_batch_is_valid_against_its_schema(llm: LLM) -> None:
    """200 sampled generations over four schemas, started together so they
    share steps with each other and with free rows: each is complete JSON
    valid against its schema, and the free rows equal their solo runs."""
    constraints = [Constraint.json_schema(s) for s in SCHEMAS]
    free = [(f"free text {i}", SamplingParams(max_tokens=24, temperature=0.9, seed=1000 + i, ignore_eos=True))
            for i in range(4)]
    want_free = [run(llm, p, params) for p, params in free]
    results: dict[int, tuple[str, str, list[int]]] = {}
    errors: list[BaseException] = []
    total = 200
    for wave in range(0, total, 50):
        sessions, generations = [], []
        for i in range(wave, wave + 50):
            s = llm.new_session()
            params = SamplingParams(max_tokens=100, temperature=1.0, seed=i, constraint=constraints[i % len(SCHEMAS)])
            sessions.append(s)
            generations.append((i, s.start(llm.encode(f"Reply in JSON, case {i}"), params)))
        free_got: list[tuple[str, str, list[int]]] = []
        thread = threading.Thread(target=lambda: free_got.extend(run(llm, p, params) for p, params in free))
        thread.start()
        for i, g in generations:
            try:
                c = g.completion() if _drain(g) else None
                assert c is not None
                results[i] = (c.text, c.finish_reason, c.token_ids)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
        thread.join()
        for s in sessions:
            s.close()
        assert free_got == want_free
    assert not errors, errors[:3]
    assert len(results) == total
    for i, (text, reason, _) in sorted(results.items()):
        assert reason == "stop", (i, text)
        jsonschema.validate(json.loads(text), SCHEMAS[i % len(SCHEMAS)])
    assert len({text for text, _, _ in results.values()}) > total // 2  # (sampled: not one text again and again)
    # Batch invariance holds with masks: each generation alone draws what it drew among the others.
    for i in range(total):
        alone = run(llm, f"Reply in JSON, case {i}",
                    SamplingParams(max_tokens=100, temperature=1.0, seed=i, constraint=constraints[i % len(SCHEMAS)]))
        assert alone == results[i]


def _drain(g: object) -> bool:
    while g.step() is not None:  # type: ignore[attr-defined]
        pass
    return True


def test_regex_lark_and_json_object(llm: LLM) -> None:
    pattern = r"[a-z]{3,6}-[0-9]{2}"
    for seed in range(6):
        text, reason, _ = run(llm, "code:", SamplingParams(max_tokens=40, temperature=1.0, seed=seed,
                                                           constraint=Constraint.regex(pattern)))
        assert re.fullmatch(pattern, text) and reason == "stop", text
    grammar = 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]{1,2}/'
    for seed in range(6):
        text, reason, _ = run(llm, "answer:", SamplingParams(max_tokens=40, temperature=1.0, seed=seed,
                                                             constraint=Constraint.lark(grammar)))
        assert re.fullmatch(r"yes|no|maybe [0-9]{1,2}", text) and reason == "stop", text
    # ignore_eos does not run a complete grammar on: the reply ends where the grammar does.
    for seed in range(4):
        text, reason, ids = run(llm, "{", SamplingParams(max_tokens=100, temperature=0.7, seed=seed, ignore_eos=True,
                                                         constraint=Constraint.regex("(ab|cd){1,3}")))
        assert re.fullmatch("(ab|cd){1,3}", text) and reason == "stop", text
        assert not set(ids) & llm.eos_token_ids
    # Any object: its strings are unbounded, so some replies run to max_tokens; those that end are objects.
    ended = 0
    for seed in range(8):
        text, reason, _ = run(llm, "json:", SamplingParams(max_tokens=100, temperature=1.0, seed=seed, ignore_eos=True,
                                                           constraint=Constraint.json_object()))
        assert text.startswith("{"), text
        if reason == "stop":
            assert isinstance(json.loads(text), dict), text
            ended += 1
    assert ended >= 2


def test_a_constraint_cut_by_max_tokens_ends_with_length(llm: LLM) -> None:
    text, reason, ids = run(llm, "x", SamplingParams(max_tokens=5, temperature=1.0, seed=3,
                                                     constraint=Constraint.regex("[a-z]{50}")))
    assert reason == "length" and len(ids) == 5 and re.fullmatch("[a-z]*", text), text


@pytest.mark.parametrize("make, message", [
    (lambda: Constraint.json_schema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "nowhere"),
    (lambda: Constraint.json_schema("{not json"), "not JSON"),
    (lambda: Constraint.json_schema([1, 2]), "a schema is a JSON object"),  # type: ignore[arg-type]
    (lambda: Constraint.regex("([a-z"), "regex"),
    (lambda: Constraint.regex(""), "empty"),
    (lambda: Constraint.lark("start: undefined_rule"), "lark"),
    (lambda: Constraint("xml", "<a/>"), "kind"),
    (lambda: Constraint.regex("a" * 100_001), "at most"),
])
def test_bad_constraints_are_refused_when_made(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]


def test_bad_params_change_nothing(llm: LLM) -> None:
    with pytest.raises(TypeError, match="constraint must be a Constraint"):
        SamplingParams(constraint='{"type": "object"}')  # type: ignore[arg-type]
    with llm.new_session() as s:
        before = s.generate(llm.encode("hello"), max_tokens=6, temperature=0).token_ids
        n = s.token_count
        with pytest.raises(TypeError):
            s.start(llm.encode("more"), max_tokens=6, constraint="json")  # type: ignore[arg-type]
        assert s.token_count == n
    with llm.new_session() as s:
        assert s.generate(llm.encode("hello"), max_tokens=6, temperature=0).token_ids == before


def test_a_recurrent_model_holds_to_its_constraint() -> None:
    """A model with recurrent state feeds each token once read (not a step
    ahead): its masks follow the same tokens, alone and batched."""
    with LLM(llm_package("mamba2", device="cpu", max_cache_len=CONTEXT), device="cpu", threads=1) as m:
        constraint = Constraint.json_schema(SCHEMAS[1])
        params = [SamplingParams(max_tokens=100, temperature=1.0, seed=seed, constraint=constraint)
                  for seed in range(6)]
        alone = [run(m, "json:", p) for p in params]
        sessions = [m.new_session() for _ in params]
        generations = [s.start(m.encode("json:"), p) for s, p in zip(sessions, params)]
        together = [(g.completion().text, g.completion().finish_reason, g.completion().token_ids)
                    for g in generations if _drain(g)]
        for s in sessions:
            s.close()
        assert together == alone
        for text, reason, _ in alone:
            assert reason == "stop", text
            jsonschema.validate(json.loads(text), SCHEMAS[1])
