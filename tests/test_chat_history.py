"""A chat's follow-up turns reuse the session's cache however the history
comes back (issue 34, item 7), on a dense (qwen3), a recurrent (lfm2) and a
window-ring (gpt_oss) package.

A recurrent or ring session rewinds only to a checkpoint: it keeps one at
each prompt's end as well as at a turn's start, so a reply that comes back
changed (without its thinking, as Qwen3's template writes it) rewinds to the
prompt before it. And a reply that comes back as the text the session
generated keeps the ids the session generated for it (llm/_prompts.py),
where encoding its text again gives others. (Through the server:
tests/test_serve.py.)"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

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
