"""kvferry.collector: the garbage collector's pauses timed, the start-up heap frozen."""

import gc

from kvferry.collector import PauseClock, paused_seconds


def test_the_pause_clock_times_each_collection_by_generation_until_removed():
    seen = []
    clock = PauseClock(lambda gen, s: seen.append((gen, s))).install()
    try:
        gc.collect(1)
        gc.collect()
    finally:
        clock.remove()
    assert [g for g, _ in seen][-2:] == [1, 2] and all(s >= 0 for _, s in seen)
    n = len(seen)
    gc.collect()
    clock.remove()  # twice: no error
    assert len(seen) == n


def test_paused_seconds_grows_by_each_collections_wall_time_and_by_nothing_else():
    import time

    kept = [[i] for i in range(200_000)]  # enough tracked objects for a measurable walk
    before = paused_seconds()
    t = time.perf_counter()
    gc.collect()
    took = time.perf_counter() - t
    grew = paused_seconds() - before
    assert 0 < grew <= took
    gc.disable()  # time without a collection adds nothing
    try:
        time.sleep(0.05)
        assert paused_seconds() - before == grew
    finally:
        gc.enable()
    assert len(kept) == 200_000


FREEZE_CHECK = """
import gc
from kvferry.collector import freeze
kept = [[i] for i in range(20_000)]  # tracked objects (lists always are) a host keeps for its lifetime
try:
    frozen = freeze()
    assert frozen >= len(kept) and gc.get_freeze_count() == frozen, (frozen, gc.get_freeze_count())
    old = {id(o) for o in gc.get_objects(generation=2)}
    assert not any(id(o) in old for o in kept)
finally:
    gc.unfreeze()
assert gc.get_freeze_count() == 0 and len(kept) == 20_000
print("ok")
"""


def test_freeze_moves_what_lives_now_out_of_later_collections():
    """In a process of its own: the freeze is process-wide, and in the suite's process the
    threads of earlier tests free frozen objects between two reads of the count."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", FREEZE_CHECK], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_long_collections_are_logged_only_where_asked(monkeypatch, caplog):
    import kvferry.collector as collector

    monkeypatch.setattr(collector, "LONG_PAUSE_S", 0.0)  # every collection is "long"
    for warn in (False, True):
        caplog.clear()
        clock = PauseClock(lambda gen, s: None, warn=warn).install()
        try:
            with caplog.at_level("WARNING", logger="kvferry.collector"):
                gc.collect()
        finally:
            clock.remove()
        logged = [r.getMessage() for r in caplog.records if r.name == "kvferry.collector"]
        assert bool(logged) == warn  # a CLI's stderr keeps its one-line errors
        assert all("generation 2" in m for m in logged)
