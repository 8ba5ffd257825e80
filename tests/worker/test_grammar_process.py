"""GrammarProcess serves exactly what StructuredOutputs serves in-process: the same compiles,
masks and completed constraints for the same calls, with the sequences split between its
children, and a clear error when a child dies; whether its batches travel through the children's
mailboxes (spinning children) or their sockets, in order either way."""
import os
import signal

import numpy as np
import pytest

from engine.core.request import StructuredOutputsParams
from engine.structured.mailbox import REPLIED
from engine.structured.manager import ALL_ALLOWED, StructuredOutputs
from engine.structured.process import GrammarProcess

SPECS = {"choice": StructuredOutputsParams(choice=["yes", "no"]),
         "regex": StructuredOutputsParams(regex="[0-9]{3}"),
         "broken": StructuredOutputsParams(regex="(ab")}


@pytest.fixture(scope="module", params=[False, True], ids=["socket", "mailbox"])
def process(request):
    # one sequence a child before any holds two: the three split between the two
    grammars = GrammarProcess(max_rows=4, num_children=2, seqs_per_child=1, spin=request.param)
    yield grammars
    grammars.close()


def compiled(grammars, count):
    results = []
    while len(results) < count:
        results += grammars.take_compiled(timeout=1.0)
    return sorted(results)


def allowed(mask_row: np.ndarray) -> np.ndarray:
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits)


def walk(grammars, tag: str):
    """Compile three specs, mask and advance two sequences to completion; everything seen."""
    ids = {name: f"{tag}-{name}" for name in SPECS}
    for name, spec in SPECS.items():
        grammars.submit(ids[name], spec)
    seen = [[(seq_id.split("-")[1], error is None) for seq_id, error in compiled(grammars, 3)]]
    rng = np.random.default_rng(0)
    live = [ids["choice"], ids["regex"]]
    for step in range(6):
        rows = [*live, "unknown"]
        grammars.request_mask(rows)
        mask, completed = grammars.take_mask()
        seen.append(([r.split("-")[-1] for r in mask.request_ids], mask.bitmask.copy(),
                     [c.split("-")[-1] for c in completed]))
        tokens = [int(rng.choice(allowed(mask.bitmask[row]))) for row in range(len(rows))]
        # the mask's own rows (a step's usual advance: GrammarProcess reuses their split), or
        # the live ones alone; a completed sequence's matcher takes nothing more
        advanced = rows if step % 2 else live
        grammars.advance(advanced, tokens[:len(advanced)])
        for seq_id in completed:
            grammars.release(seq_id)
            live.remove(seq_id)
    return seen


def test_the_process_gives_what_the_in_process_grammars_give(process):
    here, there = walk(StructuredOutputs(max_rows=4), "a"), walk(process, "b")
    assert here[0] == there[0] == [("broken", False), ("choice", True), ("regex", True)]
    for (rows_a, mask_a, done_a), (rows_b, mask_b, done_b) in zip(here[1:], there[1:]):
        assert rows_a == rows_b and done_a == done_b
        assert np.array_equal(mask_a, mask_b)
        assert (mask_a[-1] == ALL_ALLOWED).all()  # no matcher: every token
    assert sorted(sum((done for _, _, done in here[1:]), [])) == ["choice", "regex"]


def test_a_step_with_more_rows_than_the_mask_holds_is_refused(process):
    with pytest.raises(ValueError, match="at most 4"):
        process.request_mask(["a", "b", "c", "d", "e"])


def test_a_dead_child_is_a_clear_error():
    grammars = GrammarProcess(max_rows=1)
    os.kill(grammars.pids[0], signal.SIGKILL)
    with pytest.raises(RuntimeError, match="grammar process"):
        grammars.submit("a", SPECS["choice"])
        grammars.take_compiled(timeout=1.0)


def test_the_child_exits_when_closed():
    grammars = GrammarProcess(max_rows=1, num_children=2)
    grammars.close()  # waits for the children
    for pid in grammars.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_closing_kills_a_child_that_does_not_exit(monkeypatch):
    """A child stopped before it reads its socket (as one still importing xgrammar would be)
    is killed after CHILD_EXIT_WAIT, so closing never hangs on it, nor leaves the unpinning
    it does first undone."""
    import engine.structured.process as process_module

    monkeypatch.setattr(process_module, "CHILD_EXIT_WAIT", 0.2)
    grammars = GrammarProcess(max_rows=1)
    os.kill(grammars.pids[0], signal.SIGSTOP)
    grammars.close()
    with pytest.raises(ProcessLookupError):
        os.kill(grammars.pids[0], 0)


def test_a_new_spec_compiles_in_every_child_at_once(monkeypatch):
    """The first sequence of a spec goes to one child and every other child starts compiling
    it too; later sequences of that spec send no more compiles, wherever they land."""
    grammars = GrammarProcess(max_rows=2, num_children=2, seqs_per_child=1)
    sent = {id(child): [] for child in grammars._children}
    for child in grammars._children:
        send = child.send
        monkeypatch.setattr(child, "send", lambda message, log=sent[id(child)], send=send: (
            log.append(message[0]), send(message))[-1])
    first, second = (sent[id(child)] for child in grammars._children)
    grammars.submit("a", SPECS["regex"])
    assert (first, second) == (["submit"], ["precompile"])
    grammars.submit("b", SPECS["regex"])
    assert (first, second) == (["submit"], ["precompile", "submit"])
    assert compiled(grammars, 2) == [("a", None), ("b", None)]
    grammars.close()


def test_a_precompiled_spec_is_not_compiled_again():
    grammars = StructuredOutputs(max_rows=1)
    grammars.precompile(SPECS["choice"])
    grammars.submit("a", SPECS["choice"])
    assert grammars.num_compiles == 1 and compiled(grammars, 1) == [("a", None)]


def _count_posts(monkeypatch, grammars):
    posts = []
    for child in grammars._children:
        post = child.mailbox.post
        monkeypatch.setattr(child.mailbox, "post",
                            lambda *args, post=post: posts.append(post(*args)) or posts[-1])
    return posts


def test_a_spinning_childs_masks_come_through_its_mailbox(monkeypatch):
    """Once a spinning child has started, a step's mask request (its advances with it) is
    posted, not sent; the masks are those the in-process grammars give."""
    grammars = GrammarProcess(max_rows=2, spin=True)
    here = StructuredOutputs(max_rows=2)
    for g in (grammars, here):
        g.submit("a", SPECS["regex"])
    compiled(grammars, 1), compiled(here, 1)
    posts = _count_posts(monkeypatch, grammars)
    done = []
    while not done:
        for g in (grammars, here):
            g.request_mask(["a"])
        (got, done), (want, want_done) = grammars.take_mask(), here.take_mask()
        assert np.array_equal(got.bitmask, want.bitmask) and done == want_done
        token = int(allowed(want.bitmask[0])[-1])
        for g in (grammars, here):
            g.advance(["a"], [token])
    child = grammars._children[0]
    assert child.mailbox.words[REPLIED] == child.mask_number  # the reply came that way too
    grammars.close()
    assert "posted" in posts, posts


@pytest.mark.parametrize("spin", [False, True], ids=["socket", "mailbox"])
def test_a_failed_message_fails_the_mask_that_follows_it(spin):
    grammars = GrammarProcess(max_rows=1, spin=spin)
    grammars.submit("a", SPECS["choice"])
    compiled(grammars, 1)
    grammars.advance(["a"], ["not a token"])
    grammars.request_mask(["a"])
    with pytest.raises(RuntimeError, match="grammar process failed: advance"):
        grammars.take_mask()
    grammars.close()


@pytest.mark.parametrize("spin", [False, True], ids=["socket", "mailbox"])
def test_a_child_that_dies_while_the_core_waits_for_its_mask_is_a_clear_error(spin):
    grammars = GrammarProcess(max_rows=1, spin=spin)
    grammars.submit("a", SPECS["choice"])
    compiled(grammars, 1)
    os.kill(grammars.pids[0], signal.SIGKILL)
    grammars.request_mask(["a"])
    with pytest.raises(RuntimeError, match="grammar process died"):
        grammars.take_mask()
    grammars.close()


def test_batches_keep_their_order_across_mailbox_and_socket(monkeypatch):
    """A batch too large for the mailbox goes over the socket between posted ones; the child
    still runs them in order: the submit before the mask that needs its matcher."""
    import engine.structured.mailbox as mailbox

    grammars = GrammarProcess(max_rows=2, spin=True)
    grammars.submit("a", SPECS["choice"])
    compiled(grammars, 1)
    posts = _count_posts(monkeypatch, grammars)
    grammars.request_mask(["a"])
    grammars.take_mask()
    monkeypatch.setattr(mailbox, "CAPACITY", 200)  # the long spec's submit does not fit
    long_choice = StructuredOutputsParams(choice=["x" * 300, "y"])
    grammars.submit("b", long_choice)
    grammars.request_mask(["a"])
    grammars.take_mask()
    assert compiled(grammars, 1) == [("b", None)]
    grammars.request_mask(["a"])
    grammars.advance(["a"], [int(allowed(grammars.take_mask()[0].bitmask[0])[0])])
    grammars.request_mask(["a", "b"])
    mask, _ = grammars.take_mask()
    here = StructuredOutputs(max_rows=2)
    here.submit("b", long_choice)
    compiled(here, 1)
    here.request_mask(["b"])
    assert np.array_equal(mask.bitmask[1], here.take_mask()[0].bitmask[0])
    assert None in posts and "posted" in posts, posts
    grammars.close()


def test_a_release_between_two_requests_of_the_same_rows_frees_its_row():
    """The second request of the same rows reuses the first's split, until a sequence is
    released: its row then allows every token, the other row keeps its grammar's mask."""
    grammars = GrammarProcess(max_rows=2, num_children=2, seqs_per_child=1)
    for seq_id in ("a", "b"):
        grammars.submit(seq_id, SPECS["regex"])
    compiled(grammars, 2)
    masks = []
    for release in (False, False, True):
        if release:
            grammars.release("b")
        grammars.request_mask(["a", "b"])
        masks.append(grammars.take_mask()[0].bitmask.copy())
    assert np.array_equal(masks[0], masks[1]) and (masks[0][1] != ALL_ALLOWED).any()
    assert np.array_equal(masks[2][0], masks[0][0]) and (masks[2][1] == ALL_ALLOWED).all()
    grammars.close()
