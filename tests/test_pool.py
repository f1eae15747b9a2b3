"""Pooled state (docs/batching.md) on a real compiled model: a small decoder
with a paged KV pool and a recurrent slot (tests/pooled_models.py). Batched
steps against the same sessions stepped alone and against the eager module;
isolation (a session full of NaN next to clean ones); copy-on-write forks;
every lifecycle operation on pooled state; a randomized schedule of 10,000
steps; CUDA graphs per padded batch size."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aoti_sessions as ais
from aoti_sessions._session import PooledState
from conftest import on_threads, paged_package, requires_cuda
from pooled_models import MAX_PAGES, MAX_ROWS, PAGE, PREFILL, VOCAB, PagedDecoder, Reference

MAX_POSITIONS = MAX_PAGES * PAGE
ATOL = 1e-4


@pytest.fixture
def engine(paged_pkg: Path, device: str):
    with ais.Engine(paged_pkg, device=device) as eng:
        yield eng


@pytest.fixture(scope="module")
def module() -> PagedDecoder:
    return PagedDecoder().eval()


def ids(tokens: list[int], device: str) -> torch.Tensor:
    return torch.tensor([tokens], device=device)


def feed(s: ais.Session, tokens: list[int], device: str) -> torch.Tensor:
    """Feeds a prompt through prefill (chunks of up to PREFILL; a last single token through decode)."""
    out = None
    while tokens:
        chunk, tokens = tokens[:PREFILL], tokens[PREFILL:]
        if len(chunk) == 1:
            out = s.run("decode", ids(chunk, device))[0]
        else:
            out = s.run("prefill", ids(chunk, device))[0]
    assert out is not None
    return out


def ref_for(module: PagedDecoder, device: str) -> Reference:
    return Reference(module.to(device), device)


def test_the_package_declares_its_pool(engine: ais.Engine) -> None:
    pool = engine.pool
    assert pool is not None
    assert (pool["page_size"], pool["max_pages"], pool["max_rows"]) == (PAGE, MAX_PAGES, MAX_ROWS)
    assert [(t["name"], t["kind"]) for t in pool["tensors"]] == [("kv", "pages"), ("state", "slots")]
    assert engine.mutable_fqns == ()
    # The caller gives only the tokens; the engine fills the rest.
    assert "decode(" in engine.signature("decode")
    with engine.new_session() as s:
        with pytest.raises(ValueError, match="takes 1 tensor inputs besides the pooled state, got 2"):
            s.run("decode", ids([1], engine.device.type), ids([1], engine.device.type))


def test_batched_rows_equal_solo_sessions_and_the_module(engine: ais.Engine, module: PagedDecoder,
                                                         device: str) -> None:
    prompts = [[3, 4, 5, 6, 7], [9, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40]]
    batched = [engine.new_session() for _ in prompts]
    alone = [engine.new_session() for _ in prompts]
    refs = [ref_for(module, device) for _ in prompts]
    nxt = []
    for b, a, r, p in zip(batched, alone, refs, prompts):
        ob, oa, want = feed(b, p, device), feed(a, p, device), r.feed(p)
        torch.testing.assert_close(ob, want, atol=ATOL, rtol=0)
        torch.testing.assert_close(oa, want, atol=ATOL, rtol=0)
        nxt.append(int(want.argmax()))
    for _ in range(20):  # teacher-forced: every row gets the reference's greedy token
        out = engine.run_batch("decode", batched, torch.tensor([[t] for t in nxt], device=device))
        for i, (a, r) in enumerate(zip(alone, refs)):
            want = r.feed([nxt[i]])
            torch.testing.assert_close(out[i], want, atol=ATOL, rtol=0)
            torch.testing.assert_close(engine.run_batch("decode", [a], torch.tensor([[nxt[i]]], device=device))[0],
                                       want, atol=ATOL, rtol=0)
            nxt[i] = int(want.argmax())
    assert [s.length for s in batched] == [len(p) + 20 for p in prompts]
    stats = engine.stats()
    assert stats["batch_rows"] > stats["batch_runs"]


def test_no_row_reads_another_sessions_pages(engine: ais.Engine, module: PagedDecoder, device: str) -> None:
    """A session whose every unit is NaN, stepped in the same batches as clean
    ones (and padded batches on a GPU), never reaches them."""
    poison = engine.new_session()
    feed(poison, [5] * 23, device)
    state = poison.state()
    state["kv"].fill_(float("nan"))
    state["state"].fill_(float("nan"))
    poison.load_state(state)
    clean = [engine.new_session() for _ in range(3)]
    refs = [ref_for(module, device) for _ in clean]
    for s, r, p in zip(clean, refs, ([1, 2, 3], [7, 7, 7, 7, 7, 7, 7], [11, 12])):
        feed(s, p, device)
        r.feed(p)
    for step in range(12):
        rows = [clean[0], poison, clean[1], clean[2]][: 2 + step % 3]  # 2, 3, 4 rows: different buckets
        tokens = [10 + step] * len(rows)
        out = engine.run_batch("decode", rows, torch.tensor([[t] for t in tokens], device=device))
        assert torch.isnan(out[1]).all()
        for s, o in zip(rows, out):
            if s is poison:
                continue
            want = refs[clean.index(s)].feed([10 + step])
            assert torch.isfinite(o).all()
            torch.testing.assert_close(o, want, atol=ATOL, rtol=0)
    # Its pages, freed, are zeroed before anyone else holds them.
    poison.close()
    fresh, ref = engine.new_session(), ref_for(module, device)
    torch.testing.assert_close(feed(fresh, [4] * 30, device), ref.feed([4] * 30), atol=ATOL, rtol=0)


def test_batches_on_threads_at_once_stay_apart(engine: ais.Engine, module: PagedDecoder, device: str) -> None:
    """Batches of different sessions run at the same time (on lanes of their
    own) and each writes only its pages: the pool is written in place, never
    copied whole and written back over the other's work."""
    groups = [[engine.new_session() for _ in range(3)] for _ in range(2)]
    refs = [[ref_for(module, device) for _ in range(3)] for _ in range(2)]

    def work(g: int) -> int:
        worst = 0.0
        for s, r in zip(groups[g], refs[g]):
            feed(s, [g + 1, 2, 3], device)
            r.feed([g + 1, 2, 3])
        for step in range(30):
            tokens = [(g * 7 + step + i) % VOCAB for i in range(3)]
            out = engine.run_batch("decode", groups[g], torch.tensor([[t] for t in tokens], device=device))
            for o, r, t in zip(out, refs[g], tokens):
                worst = max(worst, float((o - r.feed([t])).abs().max()))
        return int(worst > ATOL)

    assert on_threads(2, device, work) == [0, 0]


def test_a_fork_shares_pages_and_copies_at_most_one_on_write(engine: ais.Engine, device: str) -> None:
    s = engine.new_session()
    feed(s, list(range(1, 23)), device)  # 22 positions: 5 full pages and a partial one
    copied = engine.stats()["pages_copied"]
    used = engine.stats()["pool_pages_used"]
    child = s.fork()
    assert engine.stats()["pages_copied"] == copied  # the fork copies nothing
    assert engine.stats()["pool_pages_used"] == used
    assert child.length == s.length == 22
    a = engine.run_batch("decode", [s], ids([50], device))
    b = engine.run_batch("decode", [child], ids([50], device))
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    # Each side wrote into the shared last page: the first one to write copied it.
    assert engine.stats()["pages_copied"] == copied + 1
    c = engine.run_batch("decode", [s, child], torch.tensor([[1], [2]], device=device))
    assert not torch.equal(c[0], c[1])  # independent from here on
    assert engine.stats()["pages_copied"] == copied + 1


def test_a_snapshot_of_pooled_state_is_its_pages_when_taken(engine: ais.Engine, module: PagedDecoder, device: str,
                                                            tmp_path: Path) -> None:
    """A pooled session's snapshot holds its pages and length of that moment
    (only the pages it uses); the session grows on; the file written later
    loads as the session was."""
    ref = ref_for(module, device)
    with engine.new_session() as s:
        feed(s, list(range(1, 12)), device)
        ref.feed(list(range(1, 12)))
        snapshot = s.snapshot()
        feed(s, list(range(20, 30)), device)  # more positions, more pages
        assert s.length == 21
        snapshot.write(tmp_path / "then.ais")
        assert 0 < snapshot.nbytes < s.snapshot().nbytes
    with engine.load_session(tmp_path / "then.ais") as loaded:
        assert loaded.length == 11
        torch.testing.assert_close(engine.run_batch("decode", [loaded], ids([7], device))[0], ref.feed([7]),
                                   atol=ATOL, rtol=0)


def test_lifecycle_on_pooled_state(engine: ais.Engine, module: PagedDecoder, device: str, tmp_path: Path) -> None:
    s, ref = engine.new_session(), ref_for(module, device)
    torch.testing.assert_close(feed(s, [3, 1, 4, 1, 5, 9, 2, 6], device), ref.feed([3, 1, 4, 1, 5, 9, 2, 6]),
                               atol=ATOL, rtol=0)
    # state() / load_state(): the session's units and its length.
    state = s.state()
    assert state.length == 8 and state["kv"].shape[0] == 2 and state["state"].shape[0] == 1
    copy = engine.new_session()
    copy.load_state(state)
    assert copy.length == 8
    # save / load_session.
    s.save(tmp_path / "s.ais")
    loaded = engine.load_session(tmp_path / "s.ais")
    assert loaded.length == 8
    # offload / restore.
    s.offload()
    assert not s.resident
    want = ref.feed([7])
    for other in (s, copy, loaded):
        torch.testing.assert_close(engine.run_batch("decode", [other], ids([7], device))[0], want,
                                   atol=ATOL, rtol=0)
    assert s.resident
    # truncate: a session holding a slot (recurrent state, which took in
    # every position) cannot rewind: refused, nothing changed.
    with pytest.raises(ValueError, match="cannot truncate session .* slot state .* cannot rewind"):
        s.truncate(4)
    assert s.length == 9 and s.state()["kv"].shape[0] == 3
    s.truncate(9)  # to its own length: nothing to forget
    with pytest.raises(ValueError, match="cannot truncate"):
        s.truncate(10)
    # reset: nothing held.
    s.reset()
    assert s.length == 0
    fresh = ref_for(module, device)
    torch.testing.assert_close(feed(s, [2, 2, 2], device), fresh.feed([2, 2, 2]), atol=ATOL, rtol=0)
    # Bad state: named, nothing written.
    bad = PooledState(copy.state().items(), length=17)  # 17 positions take 5 pages; the tensor has 3
    with pytest.raises(ValueError, match="a session of 17 positions takes"):
        copy.load_state(bad)
    with pytest.raises(TypeError, match="PooledState"):
        copy.load_state(dict(bad))
    assert copy.length == 9  # unchanged (8 loaded + 1 decoded)


def test_checkpoints_rewind_slot_state(engine: ais.Engine, module: PagedDecoder, device: str,
                                       decoder_engine: ais.Engine) -> None:
    """A slot session rewinds to a checkpoint: its slot copy comes back, the
    pages past it go, and what runs next equals a session that never went
    further. Checkpoints cost a slot each, counted as the session's bytes."""
    pool = engine.pool
    assert pool is not None
    page, slot = pool["page_bytes"], pool["slot_bytes"]
    s = engine.new_session()
    feed(s, [3, 1, 4, 1, 5], device)
    s.checkpoint()
    s.checkpoint()  # one at this length already: nothing more
    feed(s, [9, 2, 6], device)
    s.checkpoint()
    feed(s, [5, 3, 5, 8, 9, 7, 9, 3], device)  # 16 positions: 4 pages
    assert s.checkpoints == (5, 8)
    assert _bytes(engine, s) == 4 * page + 3 * slot
    # Only to a checkpoint's length; nothing changes on a refusal.
    with pytest.raises(ValueError, match="cannot rewind but to a checkpoint .it has them at 5, 8."):
        s.truncate(6)
    assert s.length == 16 and s.checkpoints == (5, 8)
    s.truncate(5)  # the checkpoint at 8 goes with the positions past 5
    assert s.length == 5 and s.checkpoints == (5,)
    assert _bytes(engine, s) == 2 * page + 2 * slot
    ref = ref_for(module, device)
    ref.feed([3, 1, 4, 1, 5])
    torch.testing.assert_close(feed(s, [7, 7], device), ref.feed([7, 7]), atol=ATOL, rtol=0)
    # Again to the same checkpoint (it stays), then on from there.
    s.truncate(5)
    ref2 = ref_for(module, device)
    ref2.feed([3, 1, 4, 1, 5])
    torch.testing.assert_close(feed(s, [2, 8], device), ref2.feed([2, 8]), atol=ATOL, rtol=0)
    # keep: the oldest go first.
    s.checkpoint(keep=1)
    assert s.checkpoints == (7,)
    assert _bytes(engine, s) == 2 * page + 2 * slot
    # A fork carries none; an offload or a reset drops them.
    child = s.fork()
    assert child.checkpoints == () and _bytes(engine, child) == 2 * page + slot
    with pytest.raises(ValueError, match="it has none"):
        child.truncate(5)
    s.offload()
    assert s.checkpoints == ()
    with pytest.raises(ValueError, match="it has none"):
        s.truncate(6)  # (an offloaded session holds its slot on the host: refused all the same)
    assert s.length == 7 and not s.resident
    s.checkpoint()
    assert s.resident and s.checkpoints == (7,)
    s.reset()
    assert s.checkpoints == () and _bytes(engine, s) == slot
    # Bad arguments, and an engine without slot state.
    with pytest.raises(ValueError, match="keep must be at least 1, got 0"):
        s.checkpoint(keep=0)
    with pytest.raises(TypeError, match="keep must be an int"):
        s.checkpoint(keep="2")  # type: ignore[arg-type]
    with decoder_engine.new_session() as other, pytest.raises(ValueError, match="needs slot state"):
        other.checkpoint()
    s.close()
    with pytest.raises(ais.SessionClosedError):
        s.checkpoint()


def _bytes(engine: ais.Engine, s: ais.Session) -> int:
    return next(x["bytes"] for x in engine.stats()["sessions"] if x["id"] == s.id)


def test_bad_batches_are_refused_and_change_nothing(engine: ais.Engine, device: str) -> None:
    a, b = engine.new_session(), engine.new_session()
    feed(a, [1, 2, 3], device)
    with pytest.raises(ValueError, match="given twice"):
        engine.run_batch("decode", [a, a], torch.tensor([[1], [1]], device=device))
    with pytest.raises(ValueError, match="has 1 rows; the batch has 2 sessions"):
        engine.run_batch("decode", [a, b], torch.tensor([[1]], device=device))
    with pytest.raises(ValueError, match="takes 1 to 8 sessions"):
        engine.run_batch("decode", [engine.new_session() for _ in range(9)],
                         torch.ones(9, 1, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="unknown method .nope."):
        engine.run_batch("nope", [a], torch.tensor([[1]], device=device))
    with pytest.raises(ValueError, match="unknown method .nope."):
        engine.captures("nope")
    assert engine.captures("decode") == (device == "cuda")  # graphs are CUDA's
    with pytest.raises(TypeError, match="sequence of Session"):
        engine.run_batch("decode", [a, "b"], torch.tensor([[1], [1]], device=device))
    with ais.Engine(paged_package(device), device=device) as other, other.new_session() as stranger:
        for rows in ([stranger, a], [a, stranger]):
            with pytest.raises(ValueError, match="another engine"):
                engine.run_batch("decode", rows, torch.tensor([[1], [1]], device=device))
    b.close()
    with pytest.raises(ais.SessionClosedError):
        engine.run_batch("decode", [a, b], torch.tensor([[1], [1]], device=device))
    assert a.length == 3
    # The context: a row that would pass it is refused before anything runs.
    feed(a, [1] * (MAX_POSITIONS - 3), device)
    with pytest.raises(ValueError, match="would pass the 40 a session holds"):
        engine.run_batch("decode", [a], torch.tensor([[1]], device=device))
    assert a.length == MAX_POSITIONS


def test_memory_is_what_sessions_hold_and_the_budget_evicts(paged_pkg: Path, device: str,
                                                           module: PagedDecoder) -> None:
    with ais.Engine(paged_pkg, device=device) as probe:
        pool = probe.pool
        assert pool is not None
        page, slot = pool["page_bytes"], pool["slot_bytes"]
    # Three sessions of 3 pages each, and room for 8 pages.
    with ais.Engine(paged_pkg, device=device, memory_budget=8 * page + 3 * slot) as eng:
        sessions = [eng.new_session() for _ in range(3)]
        refs = [ref_for(module, device) for _ in sessions]
        for s, r in zip(sessions, refs):
            feed(s, [6] * (2 * PAGE + 1), device)
            r.feed([6] * (2 * PAGE + 1))
        stats = eng.stats()
        assert stats["evictions"] >= 1 and not sessions[0].resident  # the least recently used
        assert {x["bytes"] for x in stats["sessions"]} == {3 * page + slot}
        # It comes back bit-identical when stepped.
        torch.testing.assert_close(eng.run_batch("decode", [sessions[0]], ids([8], device))[0], refs[0].feed([8]),
                                   atol=ATOL, rtol=0)
        assert eng.stats()["restores"] >= 1


# Run in a process of its own: its address space is capped (RLIMIT_AS) while one batch runs, so that the pool's
# growth, and nothing else, fails for want of memory, as cudaMalloc does on a full GPU.
OUT_OF_MEMORY = r"""
import json, resource, sys
import torch
import aoti_sessions as ais
package, saved, page, max_pages, prefill = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
eng = ais.Engine(package, max_sessions=1000)


def feed(s, n):
    while n >= 2:
        k = min(prefill, n)
        s.run("prefill", torch.ones(1, k, dtype=torch.long))
        n -= k
    if n:
        s.run("decode", torch.ones(1, 1, dtype=torch.long))


def free():  # pages the pool has and nobody holds (less its zero and scratch pages)
    stats = eng.stats()
    return stats["pool_pages"] - stats["pool_pages_used"] - 2


a, b = eng.new_session(), eng.new_session()
feed(a, page)
feed(b, page)  # both at a page's end: the next position takes a new page each
others = []
while eng.stats()["pool_pages"] < 2000 or free() != 1:  # a large pool, one page left: A takes it, B grows the pool
    f = free()
    others.append(eng.new_session())
    feed(others[-1], page * max(1, max_pages if f == 0 or f > max_pages else f - 1))
held = eng.stats()["pool_pages_used"]
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (vm + 4 * 2**20, hard))  # far less than the pool's doubling
try:
    eng.run_batch("decode", [a, b], torch.ones(2, 1, dtype=torch.long))
    error = None
except Exception as e:
    error = f"{type(e).__name__}: {e}"
finally:
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
lengths, held_after = [a.length, b.length], eng.stats()["pool_pages_used"]
a.save(saved)  # sized by its length: pages past it would be written past the copy's end
loaded = eng.load_session(saved)
same = all(torch.equal(x, y) for x, y in zip(a.state().values(), loaded.state().values()))
# The batch again, now with memory: each row as a session with the same history computes alone.
again = eng.run_batch("decode", [a, b], torch.ones(2, 1, dtype=torch.long))
alone = []
for _ in range(2):
    s = eng.new_session()
    feed(s, page)
    alone.append(s.run("decode", torch.ones(1, 1, dtype=torch.long))[0])
print(json.dumps({"error": error, "lengths": lengths, "held": [held, held_after], "same": same,
                  "again": [float((again[i] - alone[i]).abs().max()) for i in range(2)]}))
"""


def test_a_batch_whose_pages_run_out_midway_leaves_every_row_as_it_was(tmp_path: Path) -> None:
    """The device runs out of memory while a batch's rows take their new pages, after the first row took
    its own: that row gives its page back (a session holds the pages of its positions, no more: saving it,
    reading its state and offloading it size their copies by its length), every row keeps its length, and
    the batch runs right once memory is there."""
    result = subprocess.run([sys.executable, "-c", OUT_OF_MEMORY, str(paged_package("cpu")),
                             str(tmp_path / "a.ais"), str(PAGE), str(MAX_PAGES), str(PREFILL)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["error"] is not None and got["error"].startswith("DeviceError: host allocation of"), got
    assert got["lengths"] == [PAGE, PAGE]
    held, held_after = got["held"]
    assert held_after == held, f"{held_after - held} page(s) kept past their sessions' lengths"
    assert got["same"] and max(got["again"]) <= ATOL, got


def test_old_block_state_files_are_refused_with_the_reason(engine: ais.Engine, decoder_engine: ais.Engine,
                                                           tmp_path: Path) -> None:
    with decoder_engine.new_session() as s:
        s.save(tmp_path / "block.ais")
    with pytest.raises(ais.ModelMismatchError, match="per-session buffers.*pooled"):
        engine.load_session(tmp_path / "block.ais")
    with engine.new_session() as s:
        s.save(tmp_path / "pooled.ais")
    with pytest.raises(ais.ModelMismatchError, match="pooled state"):
        decoder_engine.load_session(tmp_path / "pooled.ais")


def test_randomized_schedule_of_10000_steps(engine: ais.Engine, module: PagedDecoder, device: str,
                                           tmp_path: Path) -> None:
    """Sessions join, leave, fork, save, load, offload, rewind and step in
    random batches; after every step each row equals its own eager reference."""
    rng = random.Random(18)
    live: list[tuple[ais.Session, Reference]] = []
    steps = checks = 0
    saved = 0
    while steps < 10_000:
        op = rng.random()
        if (op < 0.04 or not live) and len(live) < 12:
            s, r = engine.new_session(), ref_for(module, device)
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
            torch.testing.assert_close(feed(s, prompt, device), r.feed(prompt), atol=ATOL, rtol=0)
            live.append((s, r))
        elif op < 0.06 and len(live) > 1:
            s, _ = live.pop(rng.randrange(len(live)))
            s.close()
        elif op < 0.08 and len(live) < 12:
            s, r = rng.choice(live)
            live.append((s.fork(), r.copy()))
        elif op < 0.09:
            s, r = rng.choice(live)
            path = tmp_path / f"s{saved % 3}.ais"
            saved += 1
            s.save(path)
            live.append((engine.load_session(path), r.copy()))
        elif op < 0.11:
            rng.choice(live)[0].offload()
        else:
            rows = rng.sample(live, rng.randint(1, min(len(live), MAX_ROWS)))
            rows = [(s, r) for s, r in rows if r.length < MAX_POSITIONS]
            if not rows:
                s, _ = live.pop(rng.randrange(len(live)))
                s.close()
                continue
            tokens = [rng.randrange(VOCAB) for _ in rows]
            out = engine.run_batch("decode", [s for s, _ in rows],
                                   torch.tensor([[t] for t in tokens], device=device))
            for (s, r), t, o in zip(rows, tokens, out):
                torch.testing.assert_close(o, r.feed([t]), atol=ATOL, rtol=0)
                checks += 1
            steps += 1
    assert checks > 20_000
    stats = engine.stats()
    assert stats["offloads"] > 0 and stats["loads"] > 0 and stats["pages_copied"] > 0
    for s, _ in live:
        s.close()


@requires_cuda
def test_cuda_graphs_per_bucket_serve_changing_session_sets(module: PagedDecoder) -> None:
    with ais.Engine(paged_package("cuda"), device="cuda") as eng:
        sessions = [eng.new_session() for _ in range(MAX_ROWS)]
        refs = [ref_for(module, "cuda") for _ in sessions]
        for s, r in zip(sessions, refs):  # one prefill shape: 3 eager warm-up runs, then its graph
            torch.testing.assert_close(feed(s, [2, 3], "cuda"), r.feed([2, 3]), atol=ATOL, rtol=0)
        assert eng.stats()["graph_captures"] == 1 and eng.stats()["graph_replays"] == MAX_ROWS - 3
        rng = random.Random(5)
        for step in range(60):
            chosen = rng.sample(range(MAX_ROWS), rng.choice([1, 2, 3, 5, 8]))
            out = eng.run_batch("decode", [sessions[i] for i in chosen],
                                torch.tensor([[step % VOCAB]] * len(chosen), device="cuda"))
            for i, o in zip(chosen, out):
                torch.testing.assert_close(o, refs[i].feed([step % VOCAB]), atol=ATOL, rtol=0)
        stats = eng.stats()
        # Decode's buckets 1, 2, 4, 8: one graph each, replayed for whichever sessions fill them.
        assert stats["graph_captures"] == 1 + 4, stats
        assert stats["graph_replays"] > 40
