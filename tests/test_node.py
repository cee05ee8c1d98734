"""The node-local view (residency.multirank.node) with real processes and gloo: one host, two simulated hosts,
the node key's precedence, and the refusals (each on every rank at once, never a hang)."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from residency.core.errors import ConfigError
from residency.multirank.node import NodeView, node_view, resolve_node_key

from _dist import run_world


def _view_facts(view: NodeView) -> dict:
    members: list = [None] * view.local_world_size
    dist.all_gather_object(members, view.rank, group=view.group)  # only this node's ranks answer
    return {
        "key": view.node_key,
        "local_rank": view.local_rank,
        "local_world_size": view.local_world_size,
        "leader": view.leader,
        "is_leader": view.is_leader,
        "node_ranks": list(view.node_ranks),
        "node_index": view.node_index,
        "node_count": view.node_count,
        "world_size": view.world_size,
        "backend": dist.get_backend(view.group),
        "members": members,
    }


def _default_view_worker(rank: int, world_size: int, args) -> dict:
    view = node_view()
    facts = _view_facts(view)
    try:
        node_view(view.group)
    except ConfigError as error:
        facts["subgroup_refused"] = str(error)
    return facts


def test_one_host_is_one_node_keyed_by_the_host_name(tmp_path):
    results = run_world(_default_view_worker, 2, tmp_path)
    for rank, facts in enumerate(results):
        assert facts["key"] == os.uname().nodename, facts
        assert facts["local_rank"] == rank and facts["local_world_size"] == 2
        assert facts["node_ranks"] == [0, 1] and facts["members"] == [0, 1]
        assert facts["leader"] == 0 and facts["is_leader"] == (rank == 0)
        assert (facts["node_index"], facts["node_count"], facts["world_size"]) == (0, 1, 2)
        assert facts["backend"] == "gloo"
        assert "pass group=None" in facts["subgroup_refused"]


def _keyed_view_worker(rank: int, world_size: int, args) -> dict:
    return _view_facts(node_view(node_key=args[rank]))


def test_two_simulated_nodes_by_environment_variable(tmp_path):
    """Ranks 0, 2 on host "a" and 1, 3 on "b" (interleaved): each node has its own group."""
    env = {rank: {"RESIDENCY_NODE_KEY": "ab"[rank % 2]} for rank in range(4)}
    results = run_world(_keyed_view_worker, 4, tmp_path, env=env, args=[None] * 4)
    for rank, facts in enumerate(results):
        node = [0, 2] if rank % 2 == 0 else [1, 3]
        assert facts["key"] == "ab"[rank % 2], facts
        assert facts["node_ranks"] == node and facts["members"] == node
        assert facts["local_rank"] == node.index(rank) and facts["local_world_size"] == 2
        assert facts["leader"] == node[0] and facts["is_leader"] == (rank == node[0])
        assert (facts["node_index"], facts["node_count"], facts["world_size"]) == (rank % 2, 2, 4)


def test_the_node_key_argument_wins_over_the_environment_variable(tmp_path):
    env = {rank: {"RESIDENCY_NODE_KEY": "same"} for rank in range(2)}
    results = run_world(_keyed_view_worker, 2, tmp_path, env=env, args=["x", "y"])
    assert [facts["node_ranks"] for facts in results] == [[0], [1]], results
    assert [facts["key"] for facts in results] == ["x", "y"]


def test_a_bad_node_key_on_one_rank_is_refused_on_every_rank(tmp_path):
    """An empty $RESIDENCY_NODE_KEY on rank 1: both ranks raise at once, naming rank 1."""
    env = {1: {"RESIDENCY_NODE_KEY": ""}}
    results = run_world(_keyed_view_worker, 2, tmp_path, env=env, args=[None, None])
    for facts in results:
        assert facts["raised"] == "ConfigError", facts
        assert "{1: " in facts["message"] and "$RESIDENCY_NODE_KEY" in facts["message"]
        assert "unset RESIDENCY_NODE_KEY" in facts["message"]
        assert facts["seconds"] < 5


@pytest.mark.fast
@pytest.mark.parametrize("key", ["", "   ", 3])
def test_an_unusable_node_key_argument_is_refused(key):
    with pytest.raises(ConfigError, match="node key from node_key is .*non-empty string"):
        resolve_node_key(key)


@pytest.mark.fast
def test_the_node_view_needs_torch_distributed():
    assert not dist.is_initialized()  # the test process never joins a group
    with pytest.raises(ConfigError, match=r"call torch\.distributed\.init_process_group"):
        node_view()


@pytest.mark.fast
def test_a_node_view_checks_itself():
    with pytest.raises(ConfigError, match="rank 5 is not among its node's ranks"):
        NodeView(node_key="h", rank=5, world_size=8, node_ranks=(0, 1), node_index=0, node_count=1)
    with pytest.raises(ConfigError, match="distinct ranks in increasing order"):
        NodeView(node_key="h", rank=1, world_size=8, node_ranks=(1, 0), node_index=0, node_count=1)
