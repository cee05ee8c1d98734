"""The installed packages are the frozen set in constraints.txt (issue 10: reproducible installs).

A green run proves something only for the versions it ran with; this test says when the
environment drifted from the set the suite is known to pass with.  Move the set forward with
``.ci/update-constraints``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
#: The pinned set the environment is compared with: constraints.txt, or the set
#: .ci/update-constraints is trying (it names it in RESIDENCY_CONSTRAINTS).
CONSTRAINTS = Path(os.environ.get("RESIDENCY_CONSTRAINTS", ROOT / "constraints.txt"))


def pins() -> dict[str, str]:
    """name -> pinned version, from every `name==version` line of constraints.txt."""
    pinned = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        (specifier,) = requirement.specifier
        assert specifier.operator == "==", f"constraints.txt pins exact versions, not {line!r}"
        pinned[canonicalize_name(requirement.name)] = specifier.version
    return pinned


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@pytest.mark.fast
def test_constraints_pin_the_direct_dependencies():
    pinned = pins()
    for name in ["torch", "attrs", "pytest", "pytest-benchmark", "hypothesis", "diffusers",
                 "transformers", "tokenizers", "sentencepiece", "accelerate", "matplotlib", "peft", "torchao",
                 "gguf", "bitsandbytes"]:
        assert name in pinned, f"{name} is a dependency of the project but not pinned"


@pytest.mark.fast
def test_installed_packages_match_the_pinned_set():
    drifted = []
    for name, version in pins().items():
        found = installed_version(name)
        if name == "torch":
            if torch.accelerator.is_available():
                continue  # an accelerator machine brings its own torch build (see the README)
            found = found and found.split("+", 1)[0]
        if found != version:
            drifted.append(f"{name}: pinned {version}, installed {found}")
    if drifted:
        pytest.fail(
            f"the environment is not the pinned set in {CONSTRAINTS}:\n  " + "\n  ".join(drifted)
            + "\nInstall with "
            "`pip install -e \".[test,diffusers,peers,plot,quant,serve]\" -c constraints.txt`, "
            "or move the set forward with .ci/update-constraints"
        )


# -- the README's first command: a clean diffusers import ------------------------------------------

README = ROOT / "README.md"
#: What a user's diffusers script imports first.
DIFFUSERS_IMPORT = """
import diffusers.pipelines
from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
from transformers import UMT5EncoderModel
"""


def first_command_extras() -> set[str]:
    """The extras of the project that the README's first command installs."""
    text = README.read_text()
    block = text[text.index("```bash\n"):]
    command = block[: block.index("```", 3)]
    found = re.search(r'-e "\.\[([\w,]*)\]"', command)
    assert found, f"the README's first command installs no extras of the project:\n{command}"
    return set(found.group(1).split(","))


def installed_closure(name: str, extras: set[str]) -> set[str]:
    """`name` and everything its requirements with `extras` pull in, as installed here."""
    seen, todo = set(), [(name, extras)]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in seen or installed_version(name) is None:
            continue
        seen.add(key)
        for text in metadata.distribution(name).requires or ():
            requirement = Requirement(text)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": e}) for e in extras | {""}):
                todo.append((requirement.name, set(requirement.extras)))
    return seen


def test_a_diffusers_import_after_the_readmes_first_command_prints_nothing():
    """Every line a diffusers import prints on stderr is a line at the top of each user's script.

    The `quant` extra's torchao wheel is a CUDA build: on the CPU torch its kernels fail to load
    (one of them a cp310 ``.so`` in a 3.11 venv) and it says so at every diffusers or transformers
    import, whatever version is pinned.  Only the tests need it, so the README's first command
    leaves it out.  The import runs here with every installed package that command would not
    install hidden (``sys.modules[name] = None`` makes it absent to ``import`` and ``find_spec``).
    """
    kept = installed_closure("residency", first_command_extras())
    assert {"diffusers", "transformers"} <= kept
    hidden = sorted(module for module, dists in metadata.packages_distributions().items()
                    if not {canonicalize_name(d) for d in dists} & kept)
    hide = "import sys\nfor name in %r:\n    sys.modules[name] = None\n" % hidden
    done = subprocess.run([sys.executable, "-c", hide + DIFFUSERS_IMPORT], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == "", f"a diffusers import printed, with {sorted(first_command_extras())}:"\
        f"\n{done.stderr}"
