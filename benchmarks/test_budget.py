"""Auto plans against the budget (issue 22): at the tiny scale, the auto plan moves at most the
smaller of module mode and the best fixed layer mode at every budget from 0.2x to 1.2x, nothing
from the second call on when everything fits, and exactly what its plan predicts; its output is
bit-identical to the plain run.  The committed figures (the small scale, bytes and time per call,
the plot) come from ``python -m benchmarks.budget``: benchmarks/results/budget-*.json and
budget.png."""

from __future__ import annotations

import torch

from benchmarks import budget


def test_auto_moves_no_more_than_module_or_layer_mode_at_any_budget():
    result = budget.sweep("tiny", torch.device("cpu"))
    assert result["module_and_layer_bit_identical"]
    for row in result["rows"]:
        auto = row["auto"]
        assert "error" not in auto, row
        assert auto["bit_identical"] and auto["nbytes"] == auto["predicted"], row
        assert auto["peak"] <= row["budget"], row
        others = [row[kind]["nbytes"] for kind in ("module", "layer") if kind in row]
        assert all(auto["nbytes"] <= nbytes for nbytes in others), row
        if row["fraction"] >= 1.1:  # the layout aligns each tensor: 1.0x is a little short
            assert auto["nbytes"] == 0, row
