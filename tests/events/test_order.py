"""Parents before children (app/events/order.py): held while the parent's PUT is in progress, reordered in a
batch, each key's events always in commit order, no cycle held, nothing lost."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from app.events.order import ParentFirst, parents_first


@dataclass(frozen=True)
class Ev:
    key: str
    kind: str = "stored"
    parent_key: str | None = None
    n: int = 0


def test_child_waits_for_its_parents_put_and_each_key_keeps_its_order() -> None:
    order: ParentFirst[Ev] = ParentFirst()
    order.begin("p")
    c1 = Ev("c", parent_key="p", n=1)
    assert order.add(c1) == []  # the parent's PUT is in progress: held
    c2 = Ev("c", kind="removed", n=2)
    assert order.add(c2) == []  # behind the held store of its key
    g = Ev("g", parent_key="c", n=3)
    assert order.add(g) == []  # its parent's store is held
    other = Ev("x", parent_key="y", n=4)
    assert order.add(other) == [other]  # nothing of y in progress
    p = Ev("p", n=5)
    assert order.add(p) == [p]
    assert order.held == 3
    assert order.end("p") == [c1, c2, g]
    assert order.held == 0


def test_several_puts_of_the_parent_release_after_the_last() -> None:
    order: ParentFirst[Ev] = ParentFirst()
    order.begin("p")
    order.begin("p")
    c = Ev("c", parent_key="p")
    assert order.add(c) == []
    assert order.end("p") == []
    assert order.end("p") == [c]


def test_a_child_held_again_while_its_own_put_is_in_progress_keeps_its_children() -> None:
    order: ParentFirst[Ev] = ParentFirst()
    order.begin("p")
    order.begin("c")
    c = Ev("c", parent_key="p")
    g = Ev("g", parent_key="c")
    assert order.add(c) == [] and order.add(g) == []
    assert order.end("p") == [c]  # g waits for c's PUT, still in progress
    assert order.end("c") == [g]


def test_no_cycle_is_held() -> None:
    order: ParentFirst[Ev] = ParentFirst()
    order.begin("a")
    order.begin("b")
    a = Ev("a", parent_key="b")
    b = Ev("b", parent_key="a")
    assert order.add(a) == []  # waits on b's PUT
    assert order.add(b) == [b]  # waiting on a would be a cycle: out at once
    assert order.add(Ev("s", parent_key="s")) == [Ev("s", parent_key="s")]  # its own parent
    assert order.end("a") == []
    assert order.end("b") == [a]


def test_bounded_and_drained() -> None:
    order: ParentFirst[Ev] = ParentFirst(max_held=2)
    order.begin("p")
    a, b, c = Ev("a", parent_key="p"), Ev("b", parent_key="p"), Ev("c", parent_key="p")
    assert order.add(a) == [] and order.add(b) == []
    assert order.add(c) == [c]  # past the bound: no waiting
    g = Ev("g", parent_key="a")
    assert order.add(g) == [g]
    assert order.drain() == [a, b]
    assert order.held == 0 and order.end("p") == []


def test_parents_first_in_a_batch() -> None:
    p, q = Ev("p", n=1), Ev("q", parent_key="p", n=2)
    c = Ev("c", parent_key="p", n=0)
    c_removed = Ev("c", kind="removed", n=3)
    g = Ev("g", parent_key="c", n=4)
    assert parents_first([c, p, q, c_removed, g]) == [p, c, q, c_removed, g]
    assert parents_first([p, c]) == [p, c]
    a, b = Ev("a", parent_key="b", n=0), Ev("b", parent_key="a", n=1)
    assert parents_first([a, b]) == [b, a]  # a cycle: one of them first, each key in order


def test_parents_first_a_child_of_a_moved_parent_moves_with_it() -> None:
    """The parent's store moves after another store of its own parent later in the batch: its child, after the
    parent's store in the batch as given, moves with it (it came out first, before the parent's)."""
    g1, g2 = Ev("g", n=0), Ev("g", n=3)
    p = Ev("p", parent_key="g", n=1)
    c = Ev("c", parent_key="p", n=2)
    assert parents_first([g1, p, c, g2]) == [g1, g2, p, c]


@pytest.mark.parametrize("seed", range(200))
def test_random_puts_keep_every_event_each_key_in_order_parents_first(seed: int) -> None:
    """Random chains of PUTs that begin, commit and end in a random interleaving: every event comes out once, each
    key's in commit order, and a store comes after the stores committed by every PUT of its parent that was in
    progress when it committed."""
    rnd = random.Random(seed)
    keys = [f"k{i}" for i in range(8)]
    order: ParentFirst[Ev] = ParentFirst()
    out: list[Ev] = []
    made: list[Ev] = []
    in_progress: list[tuple[str, int]] = []  # (key, PUT id)
    committed: dict[int, Ev] = {}  # PUT id -> the store it committed
    must_follow: list[tuple[Ev, set[int]]] = []  # (child's store, the parent's PUTs in progress when it committed)
    for n in range(60):
        roll = rnd.random()
        if roll < 0.35:
            key = rnd.choice(keys)
            order.begin(key)
            in_progress.append((key, n))
        elif roll < 0.6 and in_progress:
            key, put = in_progress.pop(rnd.randrange(len(in_progress)))
            if rnd.random() < 0.7:  # it committed: its event, then the PUT ends
                ev = Ev(key, parent_key=rnd.choice([None, *keys[: keys.index(key)]]), n=n)  # chains, no circle
                made.append(ev)
                committed[put] = ev
                puts = {p for k, p in in_progress if k == ev.parent_key and k != key}
                if puts:
                    must_follow.append((ev, puts))
                out += order.add(ev)
            out += order.end(key)
        else:
            ev = Ev(rnd.choice(keys), kind="removed", n=n)
            made.append(ev)
            out += order.add(ev)
    for key, _ in in_progress:
        out += order.end(key)
    out += order.drain()
    assert sorted(e.n for e in out) == sorted(e.n for e in made)
    for key in keys:
        assert [e.n for e in out if e.key == key] == [e.n for e in made if e.key == key]
    position = {e.n: i for i, e in enumerate(out)}
    for child, puts in must_follow:
        for put in puts & committed.keys():
            assert position[committed[put].n] < position[child.n]
