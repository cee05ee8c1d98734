"""Several ranks on one host share one host master per group (issue 15, first part).

Real processes and torch.distributed gloo on the CPU (`tests/_dist.py`): each rank builds the same
model from a seed, registers it with ``Scheduler("cpu", process_group=...)``, and runs phases that
really swap (device storage is separate memory on a CPU device).  Checked on every rank: outputs
bit-identical to the model never offloaded, the master shared (one segment per node, the sum of the
ranks' PSS growth about 1x the weights), weights that differ never shared, and writes to a shared
master agreed by its ranks.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from _dist import pss_kib, run_world

_MiB = 2**20


def _model(seed: int, width: int = 256, depth: int = 4) -> nn.Sequential:
    generator = torch.Generator().manual_seed(seed)
    layers = [nn.Linear(width, width) for _ in range(depth)]
    with torch.no_grad():
        for layer in layers:
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator) * 0.05)
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=generator) * 0.05)
    return nn.Sequential(*layers)


def _phases_worker(rank: int, world_size: int, args) -> dict:
    import copy

    import torch.distributed as dist

    from residency import Scheduler

    seed = args["seed"] + (rank if args.get("differ") else 0)
    models = {"a": _model(seed), "b": _model(seed + 100)}
    plain = {name: copy.deepcopy(model) for name, model in models.items()}
    scheduler = Scheduler("cpu", process_group=dist.group.WORLD,
                          chunk_nbytes=args.get("chunk_nbytes", 2**28))
    for name, model in models.items():
        scheduler.add(name, model)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7))
    same = []
    for name in ["a", "b", "a", "b"]:
        with scheduler.resident(name):
            same.append(torch.equal(models[name](x), plain[name](x)))
    shared = {name: scheduler[name].host_master.shared_group is not None for name in models}
    scheduler.close()
    return {"same": same, "shared": shared}


@pytest.mark.parametrize("chunk_nbytes", [2**28, 2**16], ids=["one-chunk", "many-chunks"])
def test_ranks_on_one_host_share_masters_and_stay_bit_identical(tmp_path, chunk_nbytes):
    # Many chunks: each chunk is a slice of the segment, and its views start at its own offset.
    results = run_world(_phases_worker, 2, tmp_path, timeout=60,
                        args={"seed": 1, "chunk_nbytes": chunk_nbytes})
    for rank, result in enumerate(results):
        assert result is not None and "raised" not in result, (rank, result)
        assert all(result["same"]), result
        assert result["shared"] == {"a": True, "b": True}


def test_weights_that_differ_between_ranks_are_never_shared(tmp_path):
    results = run_world(_phases_worker, 2, tmp_path, timeout=60, args={"seed": 1, "differ": True})
    for rank, result in enumerate(results):
        assert result is not None and "raised" not in result, (rank, result)
        assert all(result["same"]), result
        assert result["shared"] == {"a": False, "b": False}


def test_two_nodes_share_within_each_node_only(tmp_path):
    env = {rank: {"RESIDENCY_NODE_KEY": f"node-{rank % 2}"} for rank in range(4)}
    results = run_world(_phases_worker, 4, tmp_path, timeout=90, args={"seed": 3}, env=env)
    for rank, result in enumerate(results):
        assert result is not None and "raised" not in result, (rank, result)
        assert all(result["same"]) and result["shared"] == {"a": True, "b": True}


def _pss_worker(rank: int, world_size: int, args) -> dict:
    import gc

    import torch.distributed as dist

    from residency import Scheduler

    gc.collect()
    before = pss_kib()
    scheduler = Scheduler("cpu", process_group=dist.group.WORLD)
    model = _model(5, width=2048, depth=16)  # 16 x (2048 x 2048 + 2048) float32: ~256 MiB
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    scheduler.add("big", model)
    gc.collect()
    dist.barrier()
    grown = pss_kib() - before
    dist.barrier()  # measure while every rank still maps the segment
    return {"grown_kib": grown, "nbytes": nbytes}


def test_host_memory_per_node_is_about_one_copy_of_the_weights(tmp_path):
    results = run_world(_pss_worker, 2, tmp_path, timeout=90)
    assert all(r is not None and "raised" not in r for r in results), results
    nbytes = results[0]["nbytes"]
    total = sum(r["grown_kib"] for r in results) * 1024
    assert nbytes >= 256 * _MiB * 0.99
    assert total <= 1.15 * nbytes, f"{total / nbytes:.2f}x the weights over {len(results)} ranks"


def _edit_worker(rank: int, world_size: int, args) -> dict:
    import torch.distributed as dist

    from residency import CollectiveError, Scheduler

    models = {"a": _model(11), "b": _model(12)}
    scheduler = Scheduler("cpu", process_group=dist.group.WORLD)
    for name, model in models.items():
        scheduler.add(name, model)
    weight = models["a"][0].weight
    with scheduler.resident("a"):
        if args["edit"] == "same" or (args["edit"] == "one" and rank == 0):
            weight.data.mul_(2)  # behind the version counter: only the bytes tell
        expected = weight.detach().clone()
    try:
        with scheduler.resident("b"):
            pass
    except CollectiveError as error:
        return {"raised": "CollectiveError", "message": str(error),
                "a_resident": scheduler["a"].is_resident,
                "kept": torch.equal(weight.detach(), expected)}
    written = scheduler.transitions[-1].written_back
    master = scheduler["a"].host_master.views[0]
    with scheduler.resident("a"):
        reloaded = torch.equal(weight.detach(), expected)
    scheduler.close()
    return {"written": written, "in_master": torch.equal(master, expected), "reloaded": reloaded}


def test_the_same_edit_on_every_rank_is_written_once(tmp_path):
    results = run_world(_edit_worker, 2, tmp_path, timeout=60, args={"edit": "same"})
    assert all(r is not None and "raised" not in r for r in results), results
    assert sorted(r["written"] > 0 for r in results) == [False, True], "exactly one rank writes"
    assert all(r["in_master"] and r["reloaded"] for r in results)


def test_edits_that_differ_between_ranks_raise_on_every_rank_and_lose_nothing(tmp_path):
    results = run_world(_edit_worker, 2, tmp_path, timeout=60, args={"edit": "one"})
    for rank, result in enumerate(results):
        assert result is not None and result.get("raised") == "CollectiveError", (rank, result)
        assert "'a'" in result["message"]
        assert result["a_resident"] and result["kept"], "each rank keeps its device copy"


def test_no_segment_is_left_behind(tmp_path):
    before = {name for name in os.listdir("/dev/shm") if name.startswith("residency-")}
    run_world(_phases_worker, 2, tmp_path, timeout=60, args={"seed": 2})
    after = {name for name in os.listdir("/dev/shm") if name.startswith("residency-")}
    assert after <= before


@pytest.mark.fast
def test_a_process_group_without_torch_distributed_is_refused_with_what_to_do():
    from residency import ConfigError, Scheduler

    with pytest.raises(ConfigError, match=r"call torch\.distributed\.init_process_group\(\.\.\.\) "
                                          r"on every rank first \(or do not pass a process group\)"):
        Scheduler("cpu", process_group=object())


@pytest.fixture(autouse=True)
def _forkserver_ok():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("node-shared segments live in /dev/shm")


def _adapter_worker(rank: int, world_size: int, args) -> dict:
    import sys

    import torch.distributed as dist

    sys.path.insert(0, args["tests"])
    from _tiny_pipelines import tiny_wan22, wan22_call

    from residency.adapters.diffusers import disable_offload, enable_offload

    plain, pipe = tiny_wan22(), tiny_wan22()
    scheduler = enable_offload(pipe, device="cpu", process_group=dist.group.WORLD)
    same = torch.equal(pipe(**wan22_call(seed=0)).frames, plain(**wan22_call(seed=0)).frames)
    shared = sorted(name for name in scheduler if scheduler[name].host_master.shared_group)
    disable_offload(pipe)
    return {"same": same, "shared": shared}


def test_the_diffusers_adapter_takes_the_process_group(tmp_path):
    pytest.importorskip("diffusers")
    tests = os.path.dirname(os.path.abspath(__file__))
    results = run_world(_adapter_worker, 2, tmp_path, timeout=120, args={"tests": tests})
    for rank, result in enumerate(results):
        assert result is not None and "raised" not in result, (rank, result)
        assert result["same"] and "transformer" in result["shared"], result


def _allgather_worker(rank: int, world_size: int, args) -> dict:
    import copy

    import torch.distributed as dist

    from residency import CollectiveError, RegistrationError, Scheduler

    seed = 21 + (rank if args.get("differ") else 0)
    models = {"a": _model(seed), "b": _model(seed + 1)}
    plain = {name: copy.deepcopy(model) for name, model in models.items()}
    scheduler = Scheduler("cpu", process_group=dist.group.WORLD)
    try:
        for name, model in models.items():
            scheduler.add(name, model, weight_transfer="allgather")
    except RegistrationError as error:
        return {"raised": "RegistrationError", "message": str(error)}
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7))
    if args.get("diverge"):
        try:
            with scheduler.resident("a" if rank == 0 else "b"):
                pass
        except CollectiveError as error:
            return {"raised": "CollectiveError", "message": str(error)}
        return {"raised": None}
    same, moved = [], []
    for name in ["a", "b", "a"]:
        with scheduler.resident(name):
            same.append(torch.equal(models[name](x), plain[name](x)))
        moved.append(scheduler.transitions[-1].nbytes)
    nbytes = scheduler["a"].inventory.layout.nbytes
    scheduler.close()
    return {"same": same, "moved": moved, "nbytes": nbytes}


@pytest.mark.parametrize("ranks", [2, 3])
def test_allgather_splits_the_copy_and_stays_bit_identical(tmp_path, ranks):
    results = run_world(_allgather_worker, ranks, tmp_path, timeout=90, args={})
    for rank, result in enumerate(results):
        assert result is not None and "raised" not in result, (rank, result)
        assert all(result["same"]), result
        # each rank copies its shard: about 1/k of the group's bytes, host to device
        for moved in result["moved"]:
            assert moved <= result["nbytes"] / ranks + 512, (moved, result["nbytes"])
    assert sum(r["moved"][0] for r in results) >= results[0]["nbytes"]


def test_allgather_with_weights_that_differ_is_refused_on_every_rank(tmp_path):
    results = run_world(_allgather_worker, 2, tmp_path, timeout=60, args={"differ": True})
    for rank, result in enumerate(results):
        assert result is not None and result.get("raised") == "RegistrationError", (rank, result)
        assert "weight_transfer='allgather'" in result["message"]


def test_ranks_entering_different_groups_raise_on_every_rank(tmp_path):
    results = run_world(_allgather_worker, 2, tmp_path, timeout=60, args={"diverge": True})
    for rank, result in enumerate(results):
        assert result is not None and result.get("raised") == "CollectiveError", (rank, result)
        assert "'a'" in result["message"] and "'b'" in result["message"]


@pytest.mark.fast
def test_allgather_without_ranks_to_share_is_refused():
    from residency import RegistrationError, Scheduler

    scheduler = Scheduler("cpu")
    with pytest.raises(RegistrationError, match=r"weight_transfer='allgather' splits the copy "
                                                r"among the ranks of a node, and this scheduler "
                                                r"has none; create it with Scheduler\(process"):
        scheduler.add("a", _model(1), weight_transfer="allgather")
    with pytest.raises(RegistrationError, match=r"weight_transfer='sync'; give 'rank-local'"):
        scheduler.add("a", _model(1), weight_transfer="sync")
    assert "a" not in scheduler
