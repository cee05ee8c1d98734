"""The `diffusers` extra holds everything the flagship path imports: a saved Wan2.2 folder loads
through diffusers and through residency's `from_pretrained` with only that extra installed.

No install happens here.  The test computes the extra's requirement closure from pyproject.toml
and the installed distributions' metadata, links exactly those distributions' files into a
folder, and runs the load in a child interpreter started with ``-S`` (no site-packages) whose
path is that folder and the project: what a fresh venv of ``pip install -e ".[diffusers]"``
could import, and nothing else (peft, torchao, bitsandbytes and the other test extras, which
diffusers and transformers import when they find them, are not there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys
from importlib import metadata
import torch
from diffusers import DiffusionPipeline
from residency.adapters.diffusers import disable_offload, from_pretrained

folder = sys.argv[1]
call = dict(prompt="a cat", num_inference_steps=2, height=16, width=16, num_frames=5,
            max_sequence_length=8, output_type="pt")
plain = DiffusionPipeline.from_pretrained(folder, local_files_only=True)
plain.set_progress_bar_config(disable=True)
expected = plain(**call, generator=torch.Generator().manual_seed(0)).frames
pipe = from_pretrained(DiffusionPipeline, folder, None, local_files_only=True)
pipe.set_progress_bar_config(disable=True)
output = pipe(**call, generator=torch.Generator().manual_seed(0)).frames
disable_offload(pipe)
top = {name.split(".")[0] for name in sys.modules}
found = metadata.packages_distributions()
imported = sorted({dist for name in top for dist in found.get(name, ())})
print(json.dumps({"equal": torch.equal(output, expected), "imported": imported}))
"""


def extra_closure(extra: str) -> set[str]:
    """The canonical names of residency's base requirements and `extra`'s, and of everything
    they require in turn (markers evaluated, the extras each requirement names followed),
    from pyproject.toml and the installed distributions' metadata."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [(Requirement(text), "") for text in project["dependencies"]]
    wanted += [(Requirement(text), "") for text in project["optional-dependencies"][extra]]
    closure: set[str] = set()
    while wanted:
        requirement, via_extra = wanted.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": via_extra}):
            continue
        name = canonicalize_name(requirement.name)
        if name in closure:
            continue
        closure.add(name)
        for text in metadata.requires(requirement.name) or ():
            for chosen in [""] + sorted(requirement.extras):
                wanted.append((Requirement(text), chosen))
    return closure


def link_distributions(names: set[str], into: Path) -> None:
    """Symlink every top-level file and folder of the installed distributions `names` into
    `into` (their packages, their .libs folders and their .dist-info metadata)."""
    for name in names:
        dist = metadata.distribution(name)
        site = Path(dist.locate_file(""))
        tops = {Path(str(file)).parts[0] for file in dist.files or ()}
        for top in tops - {".."}:
            target = into / top
            if not target.exists() and (site / top).exists():
                target.symlink_to(site / top)


@pytest.mark.fast
def test_the_closure_follows_the_metadata():
    closure = extra_closure("diffusers")
    assert {"torch", "attrs", "diffusers", "transformers", "accelerate", "safetensors",
            "huggingface-hub", "numpy"} <= closure
    assert not {"peft", "torchao", "bitsandbytes", "pytest", "matplotlib"} & closure


def test_a_saved_wan22_folder_loads_with_the_diffusers_extra_alone(saved_wan22, tmp_path):
    closure = extra_closure("diffusers")
    site = tmp_path / "site"
    site.mkdir()
    link_distributions(closure - {"residency"}, site)
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    done = subprocess.run([sys.executable, "-S", "-c", CHILD, str(saved_wan22)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (
        "a saved Wan2.2 folder does not load with only the diffusers extra installed; add what "
        f"it needs to pyproject.toml's diffusers extra:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["equal"], "from_pretrained's output differs from the plain pipeline's"
    outside = {canonicalize_name(name) for name in result["imported"]} - closure - {"residency"}
    assert not outside, f"imported from outside the diffusers extra: {sorted(outside)}"
