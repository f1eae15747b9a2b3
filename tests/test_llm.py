"""aoti_sessions.llm: chat sessions on an exported transformers model (a tiny
random-weight Qwen3), checked against the eager HF model's greedy generation."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import aoti_sessions as ais
from aoti_sessions.llm import LLM, SamplingParams
from conftest import on_threads, requires_cuda
from llm_models import hf_model_dir, llm_package

CONTEXT = 128
USER = [{"role": "user", "content": "Hello there, how are you today?"}]


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=requires_cuda)])
def llm(request: pytest.FixtureRequest):
    with LLM(llm_package("qwen3", device=request.param, max_cache_len=CONTEXT), device=request.param) as m:
        yield m


@pytest.fixture(scope="module")
def hf():
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_model_dir("qwen3"), local_files_only=True)
    return model.eval()


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return [int(t) for t in out[0, len(ids):]]


def greedy(llm: LLM, prompt, n: int = 10, **kw):
    with llm.new_session() as s:
        return s.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True, **kw)


def test_greedy_matches_eager_hf(llm, hf):
    ids = llm.chat_tokens(USER)
    out = greedy(llm, USER, 12)
    assert out.token_ids == hf_greedy(hf, ids, 12)
    assert out.finish_reason == "length" and out.prompt_tokens == len(ids) and out.cached_tokens == 0
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_interleaved_sessions_equal_solo(llm):
    prompts = [USER, "The quick brown fox", [{"role": "user", "content": "Tell me about the sea"}]]
    solo = [greedy(llm, p, 10).token_ids for p in prompts]
    sessions = [llm.new_session() for _ in prompts]
    gens = [s.start(p, max_tokens=10, temperature=0, ignore_eos=True) for s, p in zip(sessions, prompts)]
    while any(not g.finished for g in gens):
        for g in gens:
            g.step()
    assert [g.token_ids for g in gens] == solo
    for s in sessions:
        s.close()


def test_follow_up_turn_prefills_only_new_tokens(llm, hf):
    with llm.new_session() as s:
        first = s.generate(USER, max_tokens=6, temperature=0, ignore_eos=True)
        held = s.tokens
        assert len(held) == first.prompt_tokens + first.completion_tokens - 1  # the last token is not fed yet
        follow = list(held) + first.token_ids[-1:] + llm.encode(" and what next?")
        g = s.start(follow, max_tokens=6, temperature=0, ignore_eos=True)
        while g.step() is not None:
            pass
        assert g.cached_tokens == len(held)
        assert g.prefilled_tokens == len(follow) - len(held)
        # Same tokens as a fresh session given the whole history, and as HF.
        assert g.token_ids == greedy(llm, follow, 6).token_ids == hf_greedy(hf, follow, 6)


def test_diverging_history_rewinds_to_the_common_prefix(llm):
    base = llm.encode("One two three four five six seven")
    with llm.new_session() as s:
        s.generate(base, max_tokens=5, temperature=0)
        other = base[:4] + llm.encode(" nine ten")
        out = s.generate(other, max_tokens=8, temperature=0, ignore_eos=True)
        assert out.cached_tokens == 4
        assert out.token_ids == greedy(llm, other, 8).token_ids
        # The same prompt again: everything but its last token is reused.
        again = s.generate(other, max_tokens=8, temperature=0, ignore_eos=True)
        assert again.cached_tokens == len(other) - 1 and again.token_ids == out.token_ids


def test_streamed_pieces_join_to_the_text(llm):
    with llm.new_session() as s:
        pieces = list(s.stream("Once upon a time", max_tokens=16, temperature=0, ignore_eos=True))
    assert "".join(pieces) == greedy(llm, "Once upon a time", 16).text


def test_text_is_made_where_it_is_read(llm, monkeypatch):
    """The step loop hands out token ids: a reply's text is made by the
    thread that reads it (here the caller's, through step(), and a sink's
    caller), and only a reply with stop strings has text made in the step
    loop as well; every way gives the same text."""
    from aoti_sessions.llm.runtime import _text

    threads: list[str] = []
    push = _text.TextStream.push

    def spied(self, token):
        threads.append(threading.current_thread().name)
        return push(self, token)

    monkeypatch.setattr(_text.TextStream, "push", spied)
    read = "".join(greedy_stream(llm, "Once upon a time", 12))
    assert threads and set(threads) == {threading.current_thread().name}
    threads.clear()
    with llm.new_session() as s:
        got: list[str] = []
        done = threading.Event()
        g = s.start("Once upon a time", max_tokens=12, temperature=0, ignore_eos=True)
        g.on_event(lambda e: done.set() if e is None else got.append(e))
        assert done.wait(60)
    assert "".join(got) == read == g.text
    assert threads and set(threads) <= {threading.current_thread().name, "aoti-sessions-steps"}
    threads.clear()
    with llm.new_session() as s:
        stopped = "".join(s.stream("Once upon a time", max_tokens=12, temperature=0, ignore_eos=True,
                                   stop=["\x00never"]))
    assert stopped == read
    assert threads.count("aoti-sessions-steps") == 12 and threads.count(threading.current_thread().name) == 12


def greedy_stream(llm: LLM, prompt, n: int):
    with llm.new_session() as s:
        yield from s.stream(prompt, max_tokens=n, temperature=0, ignore_eos=True)


def test_stop_strings_and_stop_tokens(llm):
    full = greedy(llm, USER, 16)
    cut = next(i for i in range(3, len(full.text)) if full.text[i].strip())
    stop = full.text[cut:cut + 2]
    first = full.text.find(stop)
    with llm.new_session() as s:
        out = s.generate(USER, max_tokens=16, temperature=0, ignore_eos=True, stop=[stop, "\x00never"])
        assert out.finish_reason == "stop" and out.text == full.text[:first]
        streamed = "".join(s.stream(USER, max_tokens=16, temperature=0, ignore_eos=True, stop=stop))
        assert streamed == out.text
        third = full.token_ids[2]
        ended = s.generate(USER, max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[third])
        assert ended.finish_reason == "stop" and ended.token_ids == full.token_ids[:full.token_ids.index(third)]


def test_end_of_sequence_comes_from_the_package(llm):
    # Generation stops at these (unless ignore_eos): the tokenizer's own end of turn.
    assert llm.tokenizer.convert_tokens_to_ids("<|im_end|>") in llm.eos_token_ids


def test_sampling_is_seeded_and_top_k_1_is_greedy(llm):
    kw = dict(max_tokens=12, temperature=1.5, ignore_eos=True)
    with llm.new_session() as s:
        a = s.generate("The cat", seed=7, **kw).token_ids
        b = s.generate("The cat", seed=7, **kw).token_ids
        c = [s.generate("The cat", seed=k, **kw).token_ids for k in range(8, 12)]
        assert a == b and any(x != a for x in c)
        top1 = s.generate("The cat", seed=1, top_k=1, **kw).token_ids
        nucleus = s.generate("The cat", seed=1, top_p=1e-6, **kw).token_ids
    assert top1 == nucleus == greedy(llm, "The cat", 12).token_ids


def test_context_end_gives_finish_reason_length(llm):
    prompt = llm.encode("a b c d e f g h " * 40)[:CONTEXT - 3]
    with llm.new_session() as s:
        out = s.generate(prompt, max_tokens=50, temperature=0, ignore_eos=True)
        assert out.finish_reason == "length" and out.completion_tokens == 4
        assert len(s.tokens) == CONTEXT
        with pytest.raises(ValueError, match=f"context holds {CONTEXT}"):
            s.start(llm.encode("a b c d e f g h " * 40)[:CONTEXT + 1])
        # Still usable: a short prompt rewinds.
        assert s.generate("The cat", max_tokens=4, temperature=0, ignore_eos=True).token_ids == \
            greedy(llm, "The cat", 4).token_ids


@pytest.mark.parametrize("kw, error, match", [
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(max_tokens=-1), ValueError, "max_tokens"),
    (dict(max_tokens=1 << 40), ValueError, "max_tokens"),
    (dict(max_tokens=2.5), TypeError, "max_tokens"),
    (dict(temperature=-1), ValueError, "temperature"),
    (dict(temperature="hot"), TypeError, "temperature"),
    (dict(top_p=0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_k=-2), ValueError, "top_k"),
    (dict(stop=[""]), ValueError, "stop"),
    (dict(stop_token_ids=[-1]), ValueError, "stop_token_ids"),
])
def test_bad_parameters_are_refused(kw, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kw)


@pytest.mark.parametrize("prompt, error, match", [
    ("", ValueError, "empty"),
    ([], ValueError, "empty"),
    ([1, -1], ValueError, "token ids"),
    ([1, 10**9], ValueError, "token ids"),
    ([{"content": "no role"}], ValueError, "role"),
    ([{"role": "user", "content": 5}], ValueError, r"messages\[0\] must have a string 'role' and a string 'content'"),
    ([{"role": "user", "content": ["a", "b"]}], ValueError, "a string 'content'"),
    ([{"role": "user", "content": "ok \ud800"}], ValueError,
     r"messages\[0\]\['content'\] is not valid Unicode text: a lone surrogate at character 3"),
    ("text \udfff", ValueError, "the text is not valid Unicode text"),
    (42, TypeError, "prompt"),
])
def test_bad_prompts_are_refused_and_the_session_is_intact(llm, prompt, error, match):
    with llm.new_session() as s:
        before = s.generate("The cat", max_tokens=3, temperature=0).token_ids
        with pytest.raises(error, match=match):
            s.start(prompt)
        assert s.generate("The cat", max_tokens=3, temperature=0).token_ids == before


def test_one_generation_per_session(llm):
    with llm.new_session() as s:
        # Runs to the end of the context (a hundred steps): still running for the checks below.
        g = s.start(USER, temperature=0, ignore_eos=True)
        with pytest.raises(ais.errors.SessionBusyError):
            s.start(USER)
        with pytest.raises(ais.errors.SessionBusyError):
            s.reset()
        g.step()
        deadline = time.monotonic() + 60
        while g.completion_tokens < 3 and time.monotonic() < deadline:  # pieces handed out, not read
            time.sleep(0.01)
        g.close()  # cancelled: the session is free again, and the pieces not read are dropped
        assert g.step() is None and not s.busy
        assert s.generate(USER, max_tokens=4, temperature=0, ignore_eos=True).token_ids == \
            greedy(llm, USER, 4).token_ids


def test_fork_and_reset(llm):
    with llm.new_session() as s:
        s.generate(USER, max_tokens=5, temperature=0)
        follow = list(s.tokens) + llm.encode(" ok")
        with s.fork() as f:
            assert f.tokens == s.tokens
            a = f.generate(follow, max_tokens=6, temperature=0, ignore_eos=True)
            assert a.cached_tokens == len(s.tokens)
        b = s.generate(follow, max_tokens=6, temperature=0, ignore_eos=True)
        assert a.token_ids == b.token_ids
        s.reset()
        assert s.tokens == ()
        assert s.generate(follow, max_tokens=6, temperature=0, ignore_eos=True).cached_tokens == 0


def test_save_and_load_continue_identically(llm, tmp_path: Path):
    path = tmp_path / "chat.ais"
    with llm.new_session() as s:
        s.generate(USER, max_tokens=5, temperature=0)
        s.save(path)
        follow = list(s.tokens) + llm.encode(" more")
        expected = s.generate(follow, max_tokens=6, temperature=0, ignore_eos=True)
    with llm.load_session(path) as t:
        got = t.generate(follow, max_tokens=6, temperature=0, ignore_eos=True)
    assert got.cached_tokens == expected.cached_tokens and got.token_ids == expected.token_ids
    assert [p.name for p in tmp_path.iterdir()] == ["chat.ais"]  # state and tokens in one file


def test_a_chat_runs_on_while_its_file_is_written(llm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """ChatSession.save holds the chat only while its state is copied out: a
    generation goes ahead while the file is being written, and the file
    holds the chat as it was when saved (state and tokens together)."""
    import threading

    entered, release = threading.Event(), threading.Event()
    write = ais.Snapshot.write

    def slow_write(self: ais.Snapshot, path: object, attachment: bytes = b"") -> None:
        entered.set()
        assert release.wait(60), "the test never let the write go on"
        write(self, path, attachment)  # type: ignore[arg-type]

    monkeypatch.setattr(ais.Snapshot, "write", slow_write)
    path = tmp_path / "chat.ais"
    with llm.new_session() as s:
        s.generate(USER, max_tokens=4, temperature=0)
        saved = s.tokens
        saver = threading.Thread(target=s.save, args=(path,))
        saver.start()
        assert entered.wait(60)
        follow = list(saved) + llm.encode(" more")
        during = s.generate(follow, max_tokens=5, temperature=0, ignore_eos=True)  # while the write waits
        assert saver.is_alive() and not path.exists()
        release.set()
        saver.join(60)
        assert path.is_file()
    monkeypatch.undo()
    with llm.load_session(path) as loaded:
        assert loaded.tokens == saved
        again = loaded.generate(follow, max_tokens=5, temperature=0, ignore_eos=True)
    assert again.token_ids == during.token_ids and again.cached_tokens == len(saved)


def test_a_saved_chat_is_one_file_that_holds_its_tokens(llm, tmp_path: Path):
    """State and tokens are written together, atomically: a save over
    another chat's file replaces both; a session file saved without a chat's
    tokens, or with other bytes attached, is refused naming the problem;
    chats saved before (tokens in PATH.tokens.json beside the state) still
    load, their token file read only if it is a regular file."""
    import json
    import os

    path = tmp_path / "chat.ais"
    with llm.new_session() as a, llm.new_session() as b:
        a.generate(USER, max_tokens=3, temperature=0)
        b.generate("A longer prompt than the other one has", max_tokens=5, temperature=0)
        a.save(path)
        b.save(path)
        with llm.load_session(path) as loaded:
            assert loaded.tokens == b.tokens
        # A plain session file (no chat attached), and one with other bytes attached.
        b._session.save(path)
        with pytest.raises(ais.SessionFileError, match="without a chat's tokens .saved by Session.save"):
            llm.load_session(path)
        b._session.save(path, b'{"format": "mine"}')
        with pytest.raises(ais.SessionFileError, match="its attachment is not a chat's tokens"):
            llm.load_session(path)
        # The layout of earlier releases: tokens beside the state.
        b._session.save(path)
        legacy = tmp_path / "chat.ais.tokens.json"
        legacy.write_text(json.dumps(list(b.tokens)))
        with llm.load_session(path) as loaded:
            assert loaded.tokens == b.tokens
        legacy.write_text(json.dumps(list(a.tokens)))  # from another save: lengths differ
        with pytest.raises(ais.SessionFileError, match="tokens for a state of"):
            llm.load_session(path)
        legacy.unlink()
        os.mkfifo(legacy)  # never opened for a blocking read
        with pytest.raises(ais.SessionFileError, match="not a regular file"):
            llm.load_session(path)
        legacy.unlink()
        legacy.symlink_to(tmp_path / "elsewhere.json")
        with pytest.raises(ais.SessionFileError, match="unreadable token history"):
            llm.load_session(path)
    # Paths: empty, or with a NUL byte: ValueError, nothing written.
    with llm.new_session() as c:
        with pytest.raises(ValueError, match="session file path is empty"):
            c.save("")
        with pytest.raises(ValueError, match="NUL byte"):
            llm.load_session(tmp_path / "a\0b")
    # Nothing saved there: the error says so, as opening a missing file does.
    with pytest.raises(FileNotFoundError, match="no saved session") as missing:
        llm.load_session(tmp_path / "never-saved.ais")
    assert missing.value.filename == str(tmp_path / "never-saved.ais")


def test_sessions_on_threads_equal_serial(llm):
    prompts = [f"Story number {i}:" for i in range(4)]
    serial = [greedy(llm, p, 10).token_ids for p in prompts]
    sessions = [llm.new_session() for _ in prompts]
    got = on_threads(len(prompts), llm.device.type, lambda i: sessions[i].generate(
        prompts[i], max_tokens=10, temperature=0, ignore_eos=True).token_ids)
    assert got == serial
    for s in sessions:
        s.close()


def test_bad_llm_arguments_are_refused():
    from aoti_sessions.demo import compiled_decoder
    from aoti_sessions.models import SMALL

    package = llm_package("qwen3", device="cpu", max_cache_len=CONTEXT)
    with pytest.raises(TypeError, match="unexpected keyword argument 'streams'"):
        LLM(package, streams=2)  # one step loop serves every session now
    with pytest.raises(ais.PackageError, match="llm"):
        LLM(compiled_decoder(SMALL, "cpu"))


def test_a_temperature_too_small_to_divide_by_is_greedy(llm):
    with llm.new_session() as s:
        out = s.generate("The cat", max_tokens=8, temperature=1e-40, seed=3, ignore_eos=True)
    assert out.token_ids == greedy(llm, "The cat", 8).token_ids


def test_a_chat_template_that_refuses_is_a_value_error(llm):
    template = llm.tokenizer.chat_template
    llm.tokenizer.chat_template = "{{ raise_exception('roles must alternate user/assistant') }}"
    try:
        with llm.new_session() as s, pytest.raises(ValueError, match="roles must alternate"):
            s.start(USER)
    finally:
        llm.tokenizer.chat_template = template


@pytest.mark.parametrize("stop", [["x"] * 17, ["y" * 257], [""]])
def test_stop_strings_are_bounded(stop):
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=stop)


def test_text_is_held_back_only_while_it_may_begin_a_stop_string(llm):
    from aoti_sessions.llm.runtime._text import TextStream

    ids = llm.tokenizer.encode("the river and the old mill")
    text = llm.tokenizer.decode(ids)

    def run(stop):
        stream = TextStream(llm.tokenizer, stop)
        pieces = [stream.push(t) for t in ids]
        return pieces, "".join(pieces) + stream.flush(), stream.stopped

    pieces, out, stopped = run(["old m"])
    assert out == text[:text.index("old m")] and stopped
    pieces, out, stopped = run(["mill!"])  # never completes: "mill" is held back, then flushed
    assert out == text and not stopped and not "".join(pieces).endswith("mill")
    pieces, out, stopped = run(["zzz"])
    assert "".join(pieces) == text == out


def test_text_of_any_token_ids_is_the_tokenizers_decode(llm):
    """TextStream's pieces (the tokenizer's incremental decoder) join to the
    tokenizer's own decode of the ids, for random ids: characters split over
    tokens, special tokens (skipped), an unfinished character at the end; so
    does ``decoded`` (the whole text in one call)."""
    from aoti_sessions.llm.runtime._text import TextStream, _backend, decoded

    tokenizer = llm.tokenizer
    assert _backend(tokenizer) is not None  # (decoded's one-call path is the one checked here)
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        stream = TextStream(tokenizer, [])
        text = "".join(stream.push(t) for t in ids) + stream.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False), ids
        assert decoded(tokenizer, ids) == text, ids  # (a whole reply's text, in one call)


def test_threads_option_and_the_warning_without_it(caplog: pytest.LogCaptureFixture) -> None:
    """LLM(threads=N) sets the model's CPU kernel threads; without it, on a
    CPU device where torch uses every CPU, a warning names the option."""
    from aoti_sessions.llm.runtime._llm import usable_cpus

    package = llm_package("qwen3", device="cpu", max_cache_len=CONTEXT)
    before = torch.get_num_threads()
    try:
        with pytest.raises(ValueError, match="threads must be an int >= 1, got 0"):
            LLM(package, threads=0)
        with pytest.raises(ValueError, match="rewind_checkpoints must be an int >= 0, got -1"):
            LLM(package, threads=1, rewind_checkpoints=-1)
        with LLM(package, threads=1) as m:
            assert torch.get_num_threads() == 1
            assert m.new_session().generate("Hi", max_tokens=2, temperature=0).completion_tokens == 2
        cpus = usable_cpus()
        torch.set_num_threads(cpus)
        with caplog.at_level("WARNING", logger="aoti_sessions.llm"), LLM(package):
            pass
        warned = [r.getMessage() for r in caplog.records if r.name == "aoti_sessions.llm"]
        if cpus > 1:
            assert len(warned) == 1 and f"threads={cpus - 1}" in warned[0], warned
        else:
            assert warned == []  # one CPU: nothing to leave free
    finally:
        torch.set_num_threads(before)


EXIT_SCRIPT = """
import sys
from aoti_sessions.llm import LLM
llm = LLM(sys.argv[1], threads=1)
s = llm.new_session()
print(s.generate("Hello there", max_tokens=4, temperature=0).text)
s.start("Once upon a time", max_tokens=100, ignore_eos=True).step()  # still generating at exit
"""


def test_an_llm_left_open_exits_cleanly(tmp_path: Path):
    """The interpreter exits with an LLM open and a generation running (the
    README's own example leaves one open): its step loop stops first, no
    abort while the interpreter finalizes."""
    script = tmp_path / "left_open.py"
    script.write_text(EXIT_SCRIPT)
    for _ in range(3):
        done = subprocess.run([sys.executable, str(script), str(llm_package("qwen3"))], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0 and "terminate called" not in done.stderr, (done.returncode, done.stderr[-2000:])
