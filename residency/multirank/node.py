"""The node-local view of a process group: which ranks share this host, from torch.distributed only.

    dist.init_process_group("gloo", ...)          # or "nccl"; every rank of the job runs this
    node = node_view()                             # collective: every rank calls it, same place
    node.local_rank, node.local_world_size         # 1, 4 on the second rank of a 4-rank host
    node.is_leader                                 # True on one rank per host (the lowest rank)
    dist.barrier(group=node.group)                 # a gloo group of this host's ranks only

Ranks are grouped by a *node key*: the ``node_key`` argument, else the environment variable
``RESIDENCY_NODE_KEY``, else the host name.  Overriding it lets a test run two "nodes" on one
machine, and separates hosts that share a name.  The keys travel by one ``all_gather_object`` over
the job's default group; no sockets, files or discovery protocol of our own.

[Note: creating the node groups]
``torch.distributed.new_group`` is itself collective: every process of the job must enter it for
every group created, with the same ranks, in the same order, even for groups it is not a member of;
a rank that skips one or calls them in another order hangs or pairs the wrong groups.  So after the
keys are gathered every rank holds the same table, and each rank creates *every* node's group,
ordered by the node's lowest rank, keeping its own.  Because all processes of the job must take
part, the view is taken over the whole job (the default group); a sub-group is refused.

[Note: why the node group is gloo]
The node group carries host-side coordination (segment names, agreement, failure reports) as
Python objects.  gloo does that on the CPU, with the group's timeout bounding every wait, without
touching an accelerator or its streams.  A group for device collectives (an NCCL all-gather of
weights) is a separate group over the same `NodeView.node_ranks`: pass ``backend="nccl"`` for one.
"""

from __future__ import annotations

import os
from datetime import timedelta

import attrs
import torch.distributed as dist

from residency.core.errors import ConfigError

__all__ = ["NODE_KEY_VARIABLE", "NodeView", "node_view"]

#: The environment variable that overrides the node key (the host name by default).
NODE_KEY_VARIABLE = "RESIDENCY_NODE_KEY"
#: How long a node group's collectives wait for a missing rank before raising.
DEFAULT_TIMEOUT = timedelta(minutes=5)


def _check_ranks(view: NodeView, _attribute: object, node_ranks: tuple[int, ...]) -> None:
    if not node_ranks or list(node_ranks) != sorted(set(node_ranks)):
        raise ConfigError(
            f"node_ranks must be distinct ranks in increasing order, got {node_ranks}"
        )
    if view.rank not in node_ranks:
        raise ConfigError(f"rank {view.rank} is not among its node's ranks {node_ranks}")


@attrs.frozen(kw_only=True)
class NodeView:
    """This rank's place among the ranks that share its host (one result of `node_view`).

    Ranks are global ranks (``torch.distributed.get_rank()``).  The leader is the node's lowest
    rank; ``local_rank`` is this rank's index among its node's ranks.
    """

    #: The key the ranks of this node share (the host name unless overridden).
    node_key: str
    #: This process's global rank.
    rank: int
    #: The number of ranks in the job.
    world_size: int
    #: The global ranks on this node, in increasing order.
    node_ranks: tuple[int, ...] = attrs.field(converter=tuple, validator=_check_ranks)
    #: Which node this is, counting nodes by their lowest rank (0 holds rank 0).
    node_index: int
    #: How many nodes the job spans.
    node_count: int
    #: The node-local process group (gloo unless asked otherwise); ``None`` only in a view built
    #: by hand.  Every rank of `node_ranks` is a member.
    group: dist.ProcessGroup | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def local_rank(self) -> int:
        return self.node_ranks.index(self.rank)

    @property
    def local_world_size(self) -> int:
        return len(self.node_ranks)

    @property
    def leader(self) -> int:
        """The global rank that acts for the node (creates its shared segments)."""
        return self.node_ranks[0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader


def node_view(
    group: dist.ProcessGroup | None = None,
    *,
    node_key: str | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
    backend: str = "gloo",
) -> NodeView:
    """Which ranks of the job share this host; collective over the whole job.

    Every rank must call it at the same point, with the same `timeout` and `backend` (see
    [Note: creating the node groups]).  `group` must be the default group (``None``).  The key
    is `node_key`, else ``$RESIDENCY_NODE_KEY``, else the host name.  Refusals raise `ConfigError`
    with what to do; a rank that dies or never arrives makes the others raise within the default
    group's timeout.

        node = node_view(node_key=f"node{rank // 2}")   # two simulated nodes of two ranks each
    """
    _check_initialized(group)
    try:
        key, problem = resolve_node_key(node_key), None
    except ConfigError as error:  # reported through the gather, so that every rank raises it
        key, problem = "", str(error)
    table = _gather_keys(key, problem, group)
    nodes = _nodes_in_order(table)
    rank = dist.get_rank()
    mine = _create_node_groups(nodes, rank, timeout, backend)
    ranks = next(ranks for ranks in nodes if rank in ranks)
    return NodeView(
        node_key=key,
        rank=rank,
        world_size=len(table),
        node_ranks=ranks,
        node_index=nodes.index(ranks),
        node_count=len(nodes),
        group=mine,
    )


def resolve_node_key(node_key: str | None = None) -> str:
    """The node key: `node_key`, else ``$RESIDENCY_NODE_KEY``, else this host's name."""
    if node_key is not None:
        where = "node_key"
    elif NODE_KEY_VARIABLE in os.environ:
        node_key, where = os.environ[NODE_KEY_VARIABLE], f"${NODE_KEY_VARIABLE}"
    else:
        node_key, where = os.uname().nodename, "the host name"
    if not isinstance(node_key, str) or not node_key.strip():
        raise ConfigError(
            f"the node key from {where} is {node_key!r}; it must be a non-empty string that the "
            f"ranks of one host share (unset {NODE_KEY_VARIABLE} and pass node_key=None to use the "
            "host name)"
        )
    return node_key


def _check_initialized(group: dist.ProcessGroup | None) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            "the node view needs torch.distributed: call torch.distributed.init_process_group(...) "
            "on every rank first (or do not pass a process group)"
        )
    if group is not None and group is not dist.group.WORLD:
        raise ConfigError(
            "the node view is taken over the whole job: creating node groups needs every process "
            "of the job (see [Note: creating the node groups] in residency/multirank/node.py); pass "
            "group=None"
        )


def _gather_keys(
    key: str, problem: str | None, group: dist.ProcessGroup | None
) -> list[tuple[str, int]]:
    """(key, global rank) of every rank; every rank raises the same error if any key is bad."""
    reports: list = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(reports, (key, dist.get_rank(), problem), group=group)
    except RuntimeError as error:
        raise ConfigError(
            f"rank {dist.get_rank()}: gathering the node keys failed ({error}); a rank died, timed "
            "out or did not call node_view at this point. Every rank must call node_view at the "
            "same point; see the other ranks' logs"
        ) from error
    problems = {rank: problem for _, rank, problem in reports if problem}
    if problems:
        raise ConfigError(f"the node keys of some ranks are not usable (rank: why) {problems}")
    return [(key, rank) for key, rank, _ in reports]


def _nodes_in_order(table: list[tuple[str, int]]) -> list[tuple[int, ...]]:
    """Each node's global ranks, nodes ordered by their lowest rank (the same on every rank)."""
    by_key: dict[str, list[int]] = {}
    for key, rank in table:
        by_key.setdefault(key, []).append(rank)
    return sorted((tuple(sorted(ranks)) for ranks in by_key.values()), key=lambda r: r[0])


def _create_node_groups(
    nodes: list[tuple[int, ...]], rank: int, timeout: timedelta, backend: str
) -> dist.ProcessGroup:
    """Every node's group, created by every rank in the same order; returns this rank's."""
    mine = None
    for ranks in nodes:
        try:
            created = dist.new_group(list(ranks), timeout=timeout, backend=backend)
        except (RuntimeError, ValueError) as error:
            raise ConfigError(
                f"rank {rank}: creating the node group of ranks {list(ranks)} (backend "
                f"{backend!r}) failed ({error}); every rank of the job must call node_view with "
                "the same backend and timeout, and that backend must be available"
            ) from error
        if rank in ranks:
            mine = created
    return mine
