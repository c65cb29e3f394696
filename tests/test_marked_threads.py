"""The forwards a dynamo region installs on its copy of the blocks for a call
(``dynamo_inline.marked``), with calls in two threads: one thread's call that returns never
takes the forwards away from a call still running in the other (dynamo would then capture
that call again without them, under other names, and an edit by the first name would be
lost), and a call needing other forwards waits until the running calls return. Each step
waits on events, never on a deadline."""

from __future__ import annotations

import threading

from torch import nn

from fxprobe.frontends.dynamo_inline import marked


def _blocks() -> tuple[list[nn.Module], object, object]:
    return [nn.Linear(2, 2), nn.Linear(2, 2)], object(), object()


def test_a_call_that_returns_leaves_the_forwards_of_one_still_running() -> None:
    blocks, fwd, _ = _blocks()
    entered, left = threading.Event(), threading.Event()

    def other() -> None:
        with marked([(b, fwd) for b in blocks]):
            entered.set()
        left.set()

    with marked([(b, fwd) for b in blocks]):
        worker = threading.Thread(target=other)
        worker.start()
        assert entered.wait(60) and left.wait(60)
        assert all(b.__dict__.get("forward") is fwd for b in blocks)  # still ours
    worker.join()
    assert all("forward" not in b.__dict__ for b in blocks)  # the last call took them away


def test_a_call_needing_other_forwards_waits_for_the_running_one() -> None:
    blocks, fwd, other_fwd = _blocks()
    trying, inside = threading.Event(), threading.Event()
    seen: list[object] = []

    def other() -> None:
        trying.set()
        with marked([(b, other_fwd) for b in blocks]):
            seen.extend(b.__dict__.get("forward") for b in blocks)
            inside.set()

    with marked([(b, fwd) for b in blocks]):
        worker = threading.Thread(target=other)
        worker.start()
        assert trying.wait(60)
        assert not inside.wait(0.2)  # it waits (a short look: passing never depends on it)
        assert all(b.__dict__.get("forward") is fwd for b in blocks)
    worker.join()
    assert inside.is_set() and seen == [other_fwd, other_fwd]
    assert all("forward" not in b.__dict__ for b in blocks)


def test_a_call_nested_in_the_same_thread_replaces_them_without_waiting() -> None:
    blocks, fwd, other_fwd = _blocks()
    with marked([(b, fwd) for b in blocks]):
        with marked([(b, other_fwd) for b in blocks]):
            assert all(b.__dict__.get("forward") is other_fwd for b in blocks)
    assert all("forward" not in b.__dict__ for b in blocks)
