"""The server's API fuzzed from its own OpenAPI schema (schemathesis, over
hypothesis): every operation, with schema-valid requests (positive) and
schema-invalid ones (negative): no 5xx, every answer's status, content type
and body documented in the schema, invalid data refused with a 4xx, and the
server serving on after all of it. A real uvicorn server over the tiny
Qwen3 package, with an API key and a session dir.

A short run in the default suite (FUZZ_EXAMPLES per operation and mode);
``AOTI_SESSIONS_FUZZ_EXAMPLES=1000 pytest tests/test_serve_fuzz.py`` runs a
long one (bench/results/fuzz.md has its counts)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from llm_models import llm_package
from serving import client, open_served, serving

FUZZ_EXAMPLES = int(os.environ.get("AOTI_SESSIONS_FUZZ_EXAMPLES", "15"))
KEY = "fuzz-key-1"


def test_the_api_holds_under_fuzzing(tmp_path: Path) -> None:
    """Positive and negative cases of every operation. Excluded:
    schemathesis's check that every schema-valid request is accepted, which
    a JSON schema cannot promise here (a prompt longer than the context, a
    chat the model's template refuses, an unknown session: 400 / 404 by
    design)."""
    auth = {"Authorization": f"Bearer {KEY}"}
    with open_served(llm_package("qwen3", max_cache_len=256), max_sessions=8) as llm, \
            serving(llm, api_key=KEY, session_dir=tmp_path) as url:
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=auth)
        cases: Counter[str] = Counter()
        statuses: Counter[int] = Counter()
        failures = []
        for result in schema.get_all_operations():
            operation = result.ok()
            for mode in GenerationMode:
                @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
                @given(case=operation.as_strategy(generation_mode=mode))
                def run(case: object) -> None:
                    response = case.call_and_validate(  # type: ignore[attr-defined]
                        headers=auth, excluded_checks=[positive_data_acceptance], timeout=60)
                    cases[f"{operation.label} ({mode.value})"] += 1
                    statuses[response.status_code] += 1

                try:
                    run()
                except Unsatisfiable:
                    assert mode == GenerationMode.NEGATIVE  # nothing in it can be made invalid (no body, no params)
                except BaseException as e:  # noqa: BLE001 - every operation's failures, then one assertion
                    failures.append(f"{operation.label} ({mode.value}): {str(e)[:2000]}")
        assert not failures, "\n\n".join(failures)
        operations = [r.ok().label for r in schema.get_all_operations()]
        assert len(operations) == 18 and all(cases[f"{o} (positive)"] for o in operations), cases
        assert sum(n for k, n in cases.items() if k.endswith("(negative)")) > 0, cases
        assert all(s < 500 for s in statuses), statuses
        # Still serving.
        with client(url, headers=auth, timeout=60) as http:
            assert http.get("/health").json()["status"] == "ok"
            reply = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                             "max_tokens": 2})
            assert reply.status_code == 200, reply.text
        print(f"\nfuzzed: {sum(cases.values())} requests over {len(cases)} operation-modes; statuses "
              f"{dict(sorted(statuses.items()))}")
