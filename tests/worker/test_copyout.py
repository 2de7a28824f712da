"""Copy-out's route (tapc/worker/copyout.py `route`) on the CPU: each row of its table, and every
case against the rules as each of copy-out's paths states them (`by_path`)."""
from itertools import product

import pytest

from tapc.worker.copyout import BIG, DIRECT_BYTES, DRIVER, JOINED, POOLS, SMALL, TORCH, Route, route

KIB = 1 << 10


def case(step_bytes, fits_small=False, pending=(), counting=False, driver_events=True, steps=1,
         direct_bytes=DIRECT_BYTES):
    return dict(step_bytes=step_bytes, steps=steps, fits_small=fits_small, pending=pending, counting=counting,
                driver_events=driver_events, direct_bytes=direct_bytes)


CASES = {
    # the source
    "128 KiB goes straight from the pools": (case(128 * KIB), Route(POOLS, DRIVER)),
    "a byte more goes through the big snapshot": (case(128 * KIB + 1), Route(BIG, TORCH)),
    "or the small one, where it fits": (case(128 * KIB + 1, fits_small=True), Route(SMALL, TORCH)),
    "a step that fits the small snapshot still goes straight under the bound":
        (case(64 * KIB, fits_small=True), Route(POOLS, DRIVER)),
    "a ring's 8 steps: 128 KiB each, straight": (case(8 * 128 * KIB, steps=8), Route(POOLS, DRIVER)),
    "a ring's 8 steps: over 128 KiB each, through a snapshot":
        (case(8 * 128 * KIB + 1, steps=8, fits_small=True), Route(SMALL, TORCH)),
    "no direct bytes: every step with rows through a snapshot":
        (case(1536, fits_small=True, direct_bytes=0), Route(SMALL, TORCH)),
    "no direct bytes: a step of no rows still straight": (case(0, direct_bytes=0), Route(POOLS, DRIVER)),
    # the event of a step straight from the pools
    "the driver's event": (case(1536), Route(POOLS, DRIVER)),
    "torch's, while counting": (case(1536, counting=True), Route(POOLS, TORCH)),
    "torch's, where the driver has none": (case(1536, driver_events=False), Route(POOLS, TORCH)),
    "joined with the big snapshot's copies": (case(1536, pending=(BIG,)), Route(POOLS, JOINED, (BIG,))),
    "joined with the small snapshot's copies": (case(1536, pending=(SMALL,)), Route(POOLS, JOINED, (SMALL,))),
    "joined with both": (case(1536, pending=(BIG, SMALL), counting=True), Route(POOLS, JOINED, (BIG, SMALL))),
    "joined with both, named in any order": (case(1536, pending={SMALL, BIG}), Route(POOLS, JOINED, (BIG, SMALL))),
    # the event of a step through a snapshot
    "torch's on the snapshot's stream, never the driver's": (case(1 << 20), Route(BIG, TORCH)),
    "its own snapshot's copies are not joined": (case(1 << 20, fits_small=True, pending=(SMALL,)), Route(SMALL, TORCH)),
    "a decode step joined with a prompt step's copies":
        (case(1 << 20, fits_small=True, pending=(BIG, SMALL)), Route(SMALL, JOINED, (BIG,))),
    "a prompt step joined with decode steps' copies":
        (case(1 << 20, pending=(BIG, SMALL), counting=True), Route(BIG, JOINED, (SMALL,))),
    "torch's while counting, nothing else pending": (case(1 << 20, pending=(BIG,), counting=True), Route(BIG, TORCH)),
}


@pytest.mark.parametrize("given,want", CASES.values(), ids=CASES.keys())
def test_each_row_of_the_table(given, want):
    assert route(**given) == want


def by_path(step_bytes, steps, fits_small, pending, counting, driver_events, direct_bytes):
    """The route as each path states it: a step under the bound copies from the pools
    (`_copy_direct`), joined with every snapshot pending, with the driver's event only where
    none is and nothing is counted; any other step takes the small snapshot where it fits (else
    the big one), torch's event on its stream, joined with the other snapshot's copies where
    they are pending."""
    if step_bytes <= direct_bytes * steps:
        if driver_events and not pending and not counting:
            return Route(POOLS, DRIVER)
        return Route(POOLS, JOINED, tuple(pending)) if pending else Route(POOLS, TORCH)
    snap, other = (SMALL, BIG) if fits_small else (BIG, SMALL)
    return Route(snap, JOINED, (other,)) if other in pending else Route(snap, TORCH)


def test_every_case_is_decided_as_each_path_states_it():
    """Over the bound and either side of it, a ring's steps or one, either snapshot's fit, every
    set of pending snapshots, counting or not, with or without the driver's events."""
    sizes = [(0, 1, 0), (1536, 1, 0), (1536, 1, DIRECT_BYTES), (128 * KIB, 1, DIRECT_BYTES),
             (128 * KIB + 1, 1, DIRECT_BYTES), (8 * 128 * KIB, 8, DIRECT_BYTES), (8 * 128 * KIB + 1, 8, DIRECT_BYTES),
             (1 << 30, 1, DIRECT_BYTES)]
    cases = product(sizes, [False, True], [(), (BIG,), (SMALL,), (BIG, SMALL)], [False, True], [False, True])
    for (step_bytes, steps, direct_bytes), fits_small, pending, counting, driver_events in cases:
        given = (step_bytes, steps, fits_small, pending, counting, driver_events, direct_bytes)
        assert route(*given) == by_path(*given), given
