"""tvmamp.benchmark's interleaved timing: every timed sample comes after untimed calls."""

from __future__ import annotations

import itertools

from tvmamp.benchmark import paired_medians


def test_each_timed_sample_follows_calls_of_the_same_function():
    """A timed call right after another runtime's finds that runtime's pool spinning on the
    cores (SimpleNet batch 1 at two threads: 5.3 ms after torch, 0.10 ms alone). Each round
    runs a function untimed before its timed calls, so no function's first call after a
    switch is timed."""
    calls = []
    fns = [lambda name=name: calls.append(name) for name in "ab"]
    medians = paired_medians(fns, repeat=4, number=1, settle_s=0.0)
    assert len(medians) == 2 and all(m >= 0 for m in medians)
    runs = [len(list(group)) for _, group in itertools.groupby(calls)]
    # the warm-up alternates a, b; after it every run of one function is two calls or more
    warm = runs.index(next(r for r in runs if r > 1))
    assert all(r >= 2 for r in runs[warm:]), runs
    assert len(runs[warm:]) == 2 * 4
