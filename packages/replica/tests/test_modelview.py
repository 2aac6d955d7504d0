"""The lane's view of the model: a host model's fragment copied straight into a buffer is the
fragment `gather_part` gives, bit for bit, for every lane and fragment (`Transfers.snapshot`
relies on it to skip the flat copy)."""

from __future__ import annotations

import pytest
import torch

from diloco_replica.round.lanes import Lanes
from diloco_replica.loop.modelview import model_view


@pytest.mark.parametrize("lanes", [1, 2, 3])
@pytest.mark.parametrize("parts", [1, 2, 5])
def test_a_fragment_copied_into_a_buffer_is_the_gathered_one(lanes, parts):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Linear(13, 3), torch.nn.Linear(3, 1, bias=False))
    model[1].to(torch.bfloat16)  # a tensor in another dtype: copied as fp32, as gathered
    for index in range(lanes):
        view = model_view(model, Lanes(index, lanes))
        for part in range(parts):
            expected = view.gather_part(part, parts)
            out = torch.full((expected.numel(),), float("nan"))
            view.copy_part_into(part, parts, out)
            assert torch.equal(out, expected), (index, part)
