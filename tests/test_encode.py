"""Chat prompts encoded piece by piece between added tokens, with the pieces
cached (llm/runtime/_encode.py): the same ids as transformers' own
``apply_chat_template(tokenize=True)``, and off where they could differ."""

from __future__ import annotations

import random

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from aoti_sessions.llm.runtime._encode import PieceEncoder, pieces_match_whole
from llm_models import CHAT_TEMPLATE, SPECIAL_TOKENS, TEXT, _train_tokenizer

WORDS = TEXT.split() + ["<|im_end|>", "<|im_start|>", "<|endoftext|>", "<|im_", "end|>", "  ", "\n", "\n\n", "\t",
                        "é", "naïve", "日本語", "🙂", "👩‍💻", "\u0301", "e\u0301", " ", "'s", "123", "٣"]


def conversation(rng: random.Random, turns: int) -> list[list[dict[str, str]]]:
    """The prompts of a chat, turn by turn: each the history so far and a new user message."""
    messages: list[dict[str, str]] = []
    prompts = []
    for _ in range(turns):
        content = "".join(rng.choice(WORDS) + rng.choice(["", " ", "", "\n"]) for _ in range(rng.randint(0, 30)))
        messages.append({"role": "user", "content": content})
        prompts.append(list(messages))
        reply = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 20)))
        messages.append({"role": "assistant", "content": reply})
    return prompts


def encoder(tokenizer: transformers.PreTrainedTokenizerBase) -> PieceEncoder:
    found = PieceEncoder(tokenizer)
    assert found.enabled
    found._to_check = 0  # no whole-text check: every result here is compared below
    return found


def test_pieces_give_the_ids_of_the_whole_prompt() -> None:
    tokenizer = _train_tokenizer()
    pieces = encoder(tokenizer)
    rng = random.Random(0)
    for chat in range(40):
        for messages in conversation(rng, 6):
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            want = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
            assert pieces.encode(text) == want, text
    assert pieces._cache  # earlier messages were not encoded again
    assert pieces.enabled


def metaspace_tokenizer(prepend_scheme: str) -> transformers.PreTrainedTokenizerFast:
    """A sentencepiece-like tokenizer: Metaspace adds '▁' before the first word
    of the whole input only ("first") or of every piece ("always")."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme)
    tokenizer.decoder = decoders.Metaspace(prepend_scheme=prepend_scheme)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS, show_progress=False)
    tokenizer.train_from_iterator([TEXT] * 4, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", unk_token=None,
                                                chat_template=CHAT_TEMPLATE, additional_special_tokens=["<|im_start|>"])


def test_a_tokenizer_whose_pieces_depend_on_the_whole_input_is_encoded_whole() -> None:
    # "first": the user's words after <|im_start|>user\n get no '▁' in the
    # whole text, but would as a piece of their own.
    first = metaspace_tokenizer("first")
    assert not pieces_match_whole(first) and not PieceEncoder(first).enabled
    messages = [{"role": "user", "content": "the quick brown fox"}]
    text = first.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = first.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    # Forced past that refusal, the first prompts' check finds the difference and turns it off.
    forced = PieceEncoder(first, by_pieces=True)
    assert forced.encode(text) == want
    assert not forced.enabled
    assert forced.encode(text + " jumps") == first.encode(text + " jumps", add_special_tokens=False)
    # "always": every piece gets its '▁', whole or not.
    always = metaspace_tokenizer("always")
    pieces = encoder(always)
    for messages in conversation(random.Random(1), 5):
        text = always.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert pieces.encode(text) == always.apply_chat_template(messages, tokenize=True,
                                                                 add_generation_prompt=True)["input_ids"]


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word"])
def test_added_tokens_that_take_their_surroundings_are_encoded_whole(flag: str) -> None:
    from tokenizers import AddedToken

    tokenizer = _train_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken("<tool>", **{flag: True})]})
    assert not pieces_match_whole(tokenizer)
    tokenizer = _train_tokenizer()
    tokenizer.split_special_tokens = True  # special tokens in the text are encoded as text
    assert not pieces_match_whole(tokenizer)
