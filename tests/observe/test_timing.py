"""`SectionTimer`: only the sections it is told to time cost events."""

import torch

from freescale.observe.timing import SectionTimer


def test_untimed_sections_run_their_body_without_marks():
    timer = SectionTimer(torch.device("cpu"), timed=frozenset({"data"}))
    ran = []
    for name in ("data", "ids_a2a", "update"):
        with timer.section(name):
            ran.append(name)
    assert ran == ["data", "ids_a2a", "update"]
    assert timer.seq == 2  # the two ends of "data" only
    assert list(timer.read_ms(timer.take())) == ["data"]


def test_every_section_is_timed_by_default():
    timer = SectionTimer(torch.device("cpu"))
    for name in ("data", "ids_a2a", "data"):
        with timer.section(name):
            pass
    assert timer.seq == 6
    assert sorted(timer.read_ms(timer.take())) == ["data", "ids_a2a"]
