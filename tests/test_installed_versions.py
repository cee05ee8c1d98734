"""The installed packages are the frozen set in constraints.txt (issue 10: reproducible installs).

A green run proves something only for the versions it ran with; this test says when the
environment drifted from the set the suite is known to pass with.  Move the set forward with
``.ci/update-constraints``.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

CONSTRAINTS = Path(__file__).resolve().parent.parent / "constraints.txt"


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


def test_constraints_pin_the_direct_dependencies():
    pinned = pins()
    for name in ["torch", "attrs", "pytest", "pytest-benchmark", "hypothesis", "diffusers",
                 "transformers", "tokenizers", "sentencepiece", "accelerate", "matplotlib", "peft", "torchao",
                 "gguf", "bitsandbytes"]:
        assert name in pinned, f"{name} is a dependency of the project but not pinned"


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
            "the environment is not the pinned set in constraints.txt:\n  " + "\n  ".join(drifted)
            + "\nInstall with `pip install -e \".[test,diffusers,peers,plot]\" -c constraints.txt`, "
            "or move the set forward with .ci/update-constraints"
        )
