"""Auto plans with several ranks on one host (issues 15 and 22 together).

Real processes and gloo on the CPU (`tests/_dist.py`).  Each rank builds the same models and adds
them to ``Scheduler("cpu", process_group=..., auto={...})``: every part's host master (own part,
kept, swapped and streamed blocks alike) is shared by the node's ranks, and the ranks choose the
same plan at the same call (they plan on bytes, entries and passes only: a rank's clock never
tips the choice), so the collective evictions stay in step.  Checked on every rank: outputs
bit-identical to the models never offloaded call by call, every master shared, the same plans
and the same bytes per call on both ranks, equal to the prediction.
"""

from __future__ import annotations

import torch
from torch import nn

from _dist import run_world
from test_multirank_layers import WIDTH, _Stack


def _worker(rank: int, world_size: int, args) -> dict:
    import copy

    import torch.distributed as dist

    from residency import Scheduler

    models = {"encoder": _Stack(seed=3, depth=2), "dit": _Stack(seed=5, depth=6)}
    plain = copy.deepcopy(models)
    total = sum(t.nbytes for m in models.values() for t in m.state_dict().values())
    scheduler = Scheduler("cpu", process_group=dist.group.WORLD,
                          auto={"device_budget": int(total * args["fraction"]), "headroom": 0})
    for name, model in models.items():
        scheduler.add(name, model)
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(7))
    same = []
    with torch.no_grad():
        for _ in range(5):  # calls 1-4 measured (each ends where the next begins): 3 and 4 steady
            with scheduler.resident("encoder"):
                h = models["encoder"](x)
                same.append(torch.equal(h, plain["encoder"](x)))
            for _ in range(3):
                with scheduler.resident("dit"):
                    same.append(torch.equal(models["dit"](h), plain["dit"](h)))
    groups = [scheduler[name] for name in models]
    shared = [part.host_master.shared_group is not None
              for group in groups for part in (group, *group.parts)]
    plan = scheduler.plan
    result = {"same": same, "shared": shared, "plans": [p.describe() for p in plan.plans.values()],
              "measured": [call.nbytes for call in plan.measured],
              "predicted": plan.predicted.nbytes, "reason": plan.reason}
    scheduler.close()
    return result


def test_two_ranks_share_every_part_and_choose_the_same_plan(tmp_path):
    for fraction in (0.4, 0.75):
        folder = tmp_path / str(fraction)
        folder.mkdir()
        results = run_world(_worker, 2, folder, timeout=90, args={"fraction": fraction})
        for rank, result in enumerate(results):
            assert result is not None and "raised" not in result, (rank, result)
            assert all(result["same"]) and len(result["same"]) == 20, result
            assert all(result["shared"]) and len(result["shared"]) > 2, result
            assert result["reason"] in ("first call observed", "a steady call measured"), result
            assert result["measured"][-2:] == [result["predicted"]] * 2, result
        assert results[0]["plans"] == results[1]["plans"]
        dit = results[0]["plans"][1]  # its blocks kept apart or streamed: parts of every kind
        assert "kept apart" in dit or "streamed" in dit, dit
        assert results[0]["measured"] == results[1]["measured"]
