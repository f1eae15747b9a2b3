"""A chat's follow-up turns reuse the session's cache however the history
comes back (issue 34, item 7), on a dense (qwen3), a recurrent (lfm2) and a
window-ring (gpt_oss) package.

A recurrent or ring session rewinds only to a checkpoint: it keeps one at
each prompt's end as well as at a turn's start, so a reply that comes back
changed (without its thinking, as Qwen3's template writes it) rewinds to the
prompt before it. And a reply that comes back as the text the session
generated keeps the ids the session generated for it (llm/runtime/_prompts.py),
where encoding its text again gives others. (Through the server:
tests/test_serve.py.)"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

from aoti_sessions.errors import SessionFileError
from aoti_sessions.llm import LLM, ChatSession, Completion
from conftest import on_threads
from llm_models import llm_package

# Qwen3's way with the history: an assistant message's thinking is left out.
THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOKENS = 4
FIRST = {"role": "user", "content": "Hello there, how are you today?"}
# Seeds whose first reply below is whole text that encodes to other ids (on
# the CPU here; searched from 0 where they are not).
SEEDS = {"qwen3": 155, "lfm2": 15, "gpt_oss": 52}


@pytest.fixture(scope="module", params=["qwen3", "lfm2", "gpt_oss"])
def llm(request: pytest.FixtureRequest) -> Iterator[LLM]:
    with LLM(llm_package(request.param), threads=1) as model:
        yield model


def solo(llm: LLM, prompt: list[int], **params: Any) -> list[int]:
    """The reply of a fresh session to ``prompt``."""
    with llm.new_session() as s:
        return s.generate(prompt, max_tokens=TOKENS, ignore_eos=True, **params).token_ids


def fed(session: ChatSession, out: Completion) -> list[int]:
    """The prompt ids ``out``'s turn fed (the session holds them, then the reply)."""
    return list(session.tokens[:out.prompt_tokens])


def test_a_reply_that_comes_back_changed_rewinds_to_its_prompts_end(llm: LLM,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every turn's history differs from what the session holds just after
    the previous prompt (the reply comes back as its answer alone). A
    recurrent or ring session rewinds to the checkpoint at that prompt's end
    (it had one only at a turn's start, which a first turn has none of: once
    reset, every later turn fed the whole history again); a dense one keeps
    that much too. Each reply equals a fresh session's to the same prompt."""
    monkeypatch.setattr(llm.tokenizer, "chat_template", THINKING_TEMPLATE)
    rewinds = llm.stats()["checkpoint_rewinds"]
    with llm.new_session() as s:
        messages = [FIRST]
        previous = 0
        for turn in range(4):
            out = s.generate(messages, max_tokens=TOKENS, temperature=0, ignore_eos=True)
            assert out.token_ids == solo(llm, fed(s, out), temperature=0), turn
            if llm.spec.recurrent:
                assert out.cached_tokens == previous, (turn, out.cached_tokens, previous)
            else:
                assert out.cached_tokens >= previous, (turn, out.cached_tokens, previous)
            previous = out.prompt_tokens
            # (The prompt as the template writes it: the earlier replies' thinking left out.)
            assert "<think>" not in llm.tokenizer.decode(fed(s, out), skip_special_tokens=False)
            messages += [{"role": "assistant", "content": f"<think>\n{out.text}\n</think>\n\nSure."},
                         {"role": "user", "content": f"And then {turn}?"}]
    if llm.spec.recurrent:
        assert llm.stats()["checkpoint_rewinds"] == rewinds + 3


def whole_reply(llm: LLM, session: ChatSession, messages: list[dict[str, str]], after: dict[str, str] | None,
                seeds: Any) -> tuple[Completion, int, list[dict[str, str]]]:
    """A sampled turn on ``session`` whose reply is whole text (a random
    model's reply often holds a stray byte, whose text U+FFFD its ids do
    not spell, or a special token, left out of its text: their ids cannot
    be kept), with the first of ``seeds`` that
    gives one (tried on forks); with ``after`` (the next user message), one
    whose text the next prompt encodes to other ids than generated. The
    turn, its seed and the next turn's messages."""
    for seed in itertools.islice(seeds, 200):
        with session.fork() as trial:
            out = trial.generate(messages, max_tokens=TOKENS, temperature=1.5, seed=seed, ignore_eos=True)
            held = fed(trial, out) + out.token_ids
        following = [*messages, {"role": "assistant", "content": out.text}, *([after] if after else [])]
        whole = "\ufffd" not in out.text and llm.tokenizer.decode(out.token_ids, skip_special_tokens=False) == out.text
        if not whole or (after is not None and llm.prompt_ids(following)[:len(held)] == held):
            continue
        got = session.generate(messages, max_tokens=TOKENS, temperature=1.5, seed=seed, ignore_eos=True)
        assert got.token_ids == out.token_ids
        return got, seed, following
    pytest.fail("no seed of 200 gives such a reply")


def test_a_reply_sent_back_as_its_text_keeps_the_ids_generated(llm: LLM) -> None:
    """A three-turn chat through messages. The first reply's text encodes to
    other ids than the ones generated, so the second prompt encoded whole
    would reuse the cache only to before them (dense), or (recurrent, ring)
    to the checkpoint at the first prompt's end; it keeps the session's own
    ids for that reply instead (a valid encoding of its text: they decode to
    it), and its turn reuses everything the session holds. So does the
    third. Each reply equals a fresh session's to the same ids."""
    with llm.new_session() as s:
        after = {"role": "user", "content": "And the weather?"}
        seeds = itertools.chain([SEEDS[llm.spec.model_type]], itertools.count())
        one, seed, messages = whole_reply(llm, s, [FIRST], after, seeds)
        prompt = fed(s, one)
        assert one.token_ids == solo(llm, prompt, temperature=1.5, seed=seed)
        held = s.token_count
        assert held == one.prompt_tokens + one.completion_tokens - 1  # (the last token is never fed)

        two, seed, messages = whole_reply(llm, s, messages, None, itertools.count())
        assert two.cached_tokens == held
        second = fed(s, two)
        assert second[:held + 1] == prompt + one.token_ids  # the reply's own ids
        assert second != llm.prompt_ids(messages[:-1])  # not those of its text encoded again
        text = llm.tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        assert llm.tokenizer.decode(second, skip_special_tokens=False) == text
        assert two.token_ids == solo(llm, second, temperature=1.5, seed=seed)
        held = s.token_count

        messages.append({"role": "user", "content": "And tomorrow?"})
        three = s.generate(messages, max_tokens=TOKENS, temperature=0, ignore_eos=True)
        assert three.cached_tokens == held == two.prompt_tokens + two.completion_tokens - 1
        third = fed(s, three)
        assert third[:held + 1] == second + two.token_ids
        text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert llm.tokenizer.decode(third, skip_special_tokens=False) == text
        assert three.token_ids == solo(llm, third, temperature=0)


def test_a_replys_ids_stay_with_a_saved_or_forked_session(llm: LLM, tmp_path: Any) -> None:
    """A fork, and a session saved and loaded, keep the ids of the reply
    too: the next turn on each is the session's own."""
    with llm.new_session() as s:
        after = {"role": "user", "content": "And the weather?"}
        seeds = itertools.chain([SEEDS[llm.spec.model_type]], itertools.count())
        one, _, messages = whole_reply(llm, s, [FIRST], after, seeds)
        s.save(tmp_path / "chat")
        with s.fork() as fork, llm.load_session(tmp_path / "chat") as loaded:
            turns = [c.generate(messages, max_tokens=TOKENS, temperature=0, ignore_eos=True) for c in (s, fork, loaded)]
            assert [t.cached_tokens for t in turns] == [one.prompt_tokens + one.completion_tokens - 1] * 3
            assert fed(fork, turns[1]) == fed(loaded, turns[2]) == fed(s, turns[0]) != llm.prompt_ids(messages)
            assert turns[0].token_ids == turns[1].token_ids == turns[2].token_ids
        # A file whose chat text and ids are not this model's is refused, naming what.
        state, attachment = llm.engine.load_session_attached(tmp_path / "chat")
        with state:
            doc = json.loads(attachment)
            assert doc["chat"]["shared"] == one.prompt_tokens + one.completion_tokens - 1  # (the tokens', not again)
            for bad in ({"ids": [llm.spec.vocab_size]}, {"marks": [[len(doc["chat"]["text"]) + 1, 1]]},
                        {"shared": -1}, {"text": None}):
                state.save(tmp_path / "bad", json.dumps({**doc, "chat": {**doc["chat"], **bad}}).encode())
                with pytest.raises(SessionFileError, match="not a chat's text and tokens of this model"):
                    llm.load_session(tmp_path / "bad")


def test_chats_on_threads_answer_as_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chats on threads at once (the prompt-end checkpoint is taken on the
    step loop's thread), each turn's reply sent back as it came or without
    its thinking, at random: each turn reuses at least its previous prompt
    and answers as a fresh session given the same ids."""
    monkeypatch.setattr(llm.tokenizer, "chat_template", THINKING_TEMPLATE)
    rng = random.Random(7)
    plans = [[rng.random() < 0.5 for _ in range(3)] for _ in range(4)]

    def chat(i: int) -> list[tuple[list[int], Completion]]:
        turns = []
        with llm.new_session() as s:
            messages = [{"role": "user", "content": f"Chat number {i}, how are you?"}]
            for thinking in plans[i]:
                out = s.generate(messages, max_tokens=TOKENS, temperature=0, ignore_eos=True)
                turns.append((fed(s, out), out))
                reply = f"<think>{out.text}</think>Sure." if thinking else out.text
                messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
        return turns

    for turns in on_threads(len(plans), "cpu", chat):
        previous = 0
        for prompt, out in turns:
            assert out.token_ids == solo(llm, prompt, temperature=0)
            assert out.cached_tokens >= previous, (out.cached_tokens, previous)
            previous = out.prompt_tokens
