"""Dynamic sampling: which groups form the batch (the rounds themselves run in the DAPO e2e)."""

from __future__ import annotations

import torch

from rlhf_megatron.controller.dynamic_sampling import select_groups


def test_select_groups_takes_the_first_informative_groups_then_tops_up() -> None:
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    informative = torch.tensor([False, False, True, True, False, False, True, True])
    rows, kept, filled = select_groups(groups, informative, 1)
    assert rows.tolist() == [2, 3] and (kept, filled) == (1, 0)
    rows, kept, filled = select_groups(groups, informative, 3)  # 2 informative + group 0
    assert rows.tolist() == [0, 1, 2, 3, 6, 7] and (kept, filled) == (2, 1)
