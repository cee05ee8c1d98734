"""Several ranks on one host, one host copy of the weights: run it with torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/multirank_torchrun.py

Every rank builds the same synthetic Wan2.2-shaped pipeline, offloads it with a scheduler that is
given the job's process group, and checks its video bit for bit against the same pipeline never
offloaded.  The ranks of the host share one host master per group (they compare their weights
first; tensor-parallel shards would each keep their own), so host memory per node is the weights
once, not once per rank.  Each rank prints one line; rank 0 then prints the host memory the ranks'
masters hold together, against what it would be if each rank kept its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from residency import Scheduler
from residency.app.synthetic import SyntheticWan22


def main() -> None:
    dist.init_process_group("gloo")  # the CPU here; NCCL beside it on GPUs
    torch.set_num_threads(1)
    rank = dist.get_rank()
    plain = SyntheticWan22.build("tiny")
    pipe = SyntheticWan22.build("tiny")
    config = {"mode": "module", "components": ["dit", "text_encoder"]}
    pipe.offload = Scheduler.from_pipeline(pipe, config, device="cpu",
                                           process_group=dist.group.WORLD)
    same = torch.equal(pipe("a red dog", steps=4, seed=0), plain("a red dog", steps=4, seed=0))
    shared = sorted(n for n in pipe.offload if pipe.offload[n].host_master.shared_group)
    print(f"rank {rank}: bit-identical={same}, groups sharing one host master: {shared}",
          flush=True)
    report_host_memory(pipe.offload)
    pipe.offload.close()
    dist.barrier()
    dist.destroy_process_group()
    if not same:
        raise SystemExit(1)


def report_host_memory(scheduler: Scheduler) -> None:
    """Rank 0 prints the bytes of every rank's host masters, a shared master counted once."""
    masters = [scheduler[name].host_master for name in scheduler]
    own = sum(m.nbytes for m in masters if m.shared_group is None)
    shared = sum(m.nbytes for m in masters if m.shared_group is not None)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, (own, shared))  # every rank's (own, shared) bytes
    if dist.get_rank() == 0:
        held = sum(own for own, _ in ranks) + max(shared for _, shared in ranks)  # one host
        each_own = sum(own + shared for own, shared in ranks)
        print(f"host masters of all {len(ranks)} ranks: {held} bytes ({each_own} bytes if "
              "each rank kept its own)", flush=True)


if __name__ == "__main__":
    main()
