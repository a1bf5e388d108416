"""The residency invariants both planners keep, checked on host copies of their maps.

One check for the host planner's maps and the device planner's (read back to the host):
``slot_to_row`` and ``row_to_slot`` inverse on occupied slots, no row in two slots, pins
never negative (zero when drained), no empty slot dirty. For tests and debug checks only:
it reads every slot.
"""

from __future__ import annotations

from typing import List

import torch


def map_problems(slot_to_row: torch.Tensor, row_to_slot: torch.Tensor, pins: torch.Tensor, dirty: torch.Tensor,
                 expect_drained: bool = False) -> List[str]:
    """The breaches found (empty: none). ``slot_to_row``, ``pins`` and ``dirty`` have one
    entry per cache slot, ``row_to_slot`` one per store row; all on the host."""
    occ = torch.nonzero(slot_to_row >= 0).flatten()
    rows = slot_to_row[occ]
    problems = []
    if rows.numel() != torch.unique(rows).numel():
        problems.append("a row is mapped to two slots")
    if not torch.equal(row_to_slot[rows].long(), occ):
        problems.append("row_to_slot and slot_to_row disagree")
    if int((row_to_slot >= 0).sum()) != occ.numel():
        problems.append("row_to_slot maps rows to empty slots")
    if bool((pins < 0).any()):
        problems.append("a pin count went negative")
    if bool((dirty & (slot_to_row < 0)).any()):
        problems.append("an empty slot is marked dirty")
    if expect_drained and int(pins.sum()) != 0:
        problems.append(f"{int(pins.sum())} pins left after drain")
    return problems
