"""The torchrun example runs: two real ranks share their host masters and stay bit-identical.

It is also the test of `Scheduler.from_pipeline(..., process_group=...)` on the synthetic pipeline.
"""

import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "multirank_torchrun.py"


@pytest.mark.beside  # long, with processes of its own: see tests/_accelerator.py
def test_the_torchrun_example_runs_on_two_ranks():
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", str(EXAMPLE)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        assert (f"rank {rank}: bit-identical=True, groups sharing one host master: "
                "['text_encoder', 'transformer', 'transformer_2', 'vae']") in done.stdout
    # The memory line the docstring promises: every group shared, so the weights once, not twice.
    held, each_own = re.search(r"host masters of all 2 ranks: (\d+) bytes \((\d+) bytes if "
                               r"each rank kept its own\)", done.stdout).groups()
    assert int(held) > 0 and int(each_own) == 2 * int(held)
