"""``fetch.disk_depth.choose_disk_depth``: the disk hop's depth from measured figures, on
fixed numbers (this machine's disk: ~650 us a read, ~100k reads/s with 64 in flight)."""

import pytest

from torchrec_proactive.fetch.disk_depth import choose_disk_depth


def test_reads_that_fit_a_step_need_one_step_of_lead():
    c = choose_disk_depth(650e-6, 100_000, 500, 10e-3, depth=1)
    assert c.reads_per_s == pytest.approx(64 / 650e-6)  # the in-flight limit binds before the disk
    assert c.batch_read_s == pytest.approx(650e-6 + 499 / (64 / 650e-6))
    assert (c.disk_depth, c.lead_steps, c.disk_bound, c.stall_per_step_s, c.capped_by) == (2, 1, False, 0.0, None)


def test_shorter_steps_need_more_lead_and_say_when_the_disk_is_the_bound():
    c = choose_disk_depth(650e-6, 100_000, 500, 2e-3, depth=1)
    assert (c.lead_steps, c.disk_depth, c.disk_bound) == (3, 4, True)  # 5.72 ms of reads, 2 ms steps
    assert c.stall_per_step_s == pytest.approx(500 / (64 / 650e-6) - 2e-3)
    # A disk that reaches fewer reads/s than the in-flight limit allows is the rate.
    slow = choose_disk_depth(650e-6, 20_000, 500, 10e-3, depth=2)
    assert slow.reads_per_s == 20_000 and slow.lead_steps == 3 and slow.disk_depth == 5 and slow.disk_bound


def test_one_read_in_flight_needs_a_deep_lead_and_caps_apply():
    c = choose_disk_depth(650e-6, 100_000, 500, 10e-3, depth=1, max_in_flight=1)
    assert c.reads_per_s == pytest.approx(1 / 650e-6) and c.lead_steps == 33 and c.disk_depth == 34
    capped = choose_disk_depth(650e-6, 100_000, 500, 10e-3, depth=1, max_in_flight=1, max_disk_depth=8)
    assert (capped.disk_depth, capped.capped_by) == (8, "max_disk_depth")
    # The host cache holds 3 batches' rows: the staged and planned batches take disk_depth + 1.
    room = choose_disk_depth(650e-6, 100_000, 500, 2e-3, depth=1, host_cache_rows=3000, rows_per_step=1000)
    assert (room.disk_depth, room.capped_by, room.lead_steps) == (2, "host cache", 3)


def test_edges():
    # A whole number of steps is not rounded up by float noise: 10 ms of reads, 5 ms steps.
    assert choose_disk_depth(1e-3, 1000, 10, 5e-3, depth=0).lead_steps == 2
    assert choose_disk_depth(650e-6, 100_000, 0, 10e-3, depth=3).disk_depth == 3  # nothing to read
    with pytest.raises(ValueError, match="step_s must be > 0, got 0"):
        choose_disk_depth(650e-6, 100_000, 500, 0)
    with pytest.raises(ValueError, match=r"max_disk_depth >= depth \(got 1\)"):
        choose_disk_depth(650e-6, 100_000, 500, 1e-3, depth=2, max_disk_depth=1)
