"""`.ci/update-constraints` moves the pinned set forward, in its dry mode: a given freeze listing
stands in for the resolver, so nothing is installed or downloaded.

It rewrites constraints.txt only when the suite passed against the new set, and the suite's
installed-versions check compares with that new set (``RESIDENCY_CONSTRAINTS``), not the old one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "update-constraints"
HEADER = "# the frozen set\n# used by .ci/run\n# move it with .ci/update-constraints\n"


def update(tmp_path: Path, frozen: str, suite: str) -> tuple[subprocess.CompletedProcess, Path]:
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(HEADER + "attrs==1.0\ntorch==2.0.0\n")
    freeze = tmp_path / "freeze.txt"
    freeze.write_text(frozen)
    done = subprocess.run(["bash", str(SCRIPT), "--freeze", str(freeze), "--suite", suite,
                           "--constraints", str(constraints)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    return done, constraints


def test_a_green_suite_rewrites_the_pins_under_the_old_header(tmp_path):
    done, constraints = update(tmp_path, "torch==2.14.0+cpu\n-e git+https://x#egg=residency\n"
                               "Attrs==26.1.0\n# a comment\n", f"{sys.executable} -c pass")
    assert done.returncode == 0, done.stderr
    assert constraints.read_text() == HEADER + "Attrs==26.1.0\ntorch==2.14.0\n"
    assert "rewritten from a green run" in done.stdout


def test_a_failing_suite_leaves_the_pins_as_they_were(tmp_path):
    done, constraints = update(tmp_path, "attrs==26.1.0\n",
                               f"{sys.executable} -c 'import sys; sys.exit(3)'")
    assert done.returncode == 1
    assert constraints.read_text() == HEADER + "attrs==1.0\ntorch==2.0.0\n"
    assert "the suite failed against the new set (exit 3)" in done.stderr
    assert "is unchanged" in done.stderr


def test_the_suite_is_told_which_set_it_is_checked_against(tmp_path):
    probe = ("import os, sys; text = open(os.environ['RESIDENCY_CONSTRAINTS']).read(); "
             "sys.exit(0 if 'attrs==26.1.0' in text else 4)")
    done, constraints = update(tmp_path, "attrs==26.1.0\n", f"{sys.executable} -c \"{probe}\"")
    assert done.returncode == 0, done.stderr
    assert "attrs==26.1.0" in constraints.read_text()


def test_a_missing_freeze_listing_is_refused_before_any_work(tmp_path):
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(HEADER)
    done = subprocess.run(["bash", str(SCRIPT), "--freeze", str(tmp_path / "none.txt"),
                           "--constraints", str(constraints)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "--freeze" in done.stderr and "no such file; give a `pip freeze` listing" in done.stderr
    assert constraints.read_text() == HEADER


def test_the_installed_versions_check_compares_with_the_set_it_is_given(tmp_path):
    """Newer releases than constraints.txt pass the check when they are the set being tried."""
    check = "tests/test_installed_versions.py::test_installed_packages_match_the_pinned_set"
    attrs_version = metadata.version("attrs")
    tried = (ROOT / "constraints.txt").read_text()
    cases = {"same": tried, "drifted": tried.replace(f"attrs=={attrs_version}", "attrs==1.0")}
    outcomes = {}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        env = {key: value for key, value in os.environ.items()
               if key != "RESIDENCY_MIN_ACCELERATOR_TESTS"}  # .ci/run's floor: not this child's
        env["RESIDENCY_CONSTRAINTS"] = str(tmp_path / name)
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "--accelerator=none", check], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        outcomes[name] = done
    assert outcomes["same"].returncode == 0, outcomes["same"].stdout[-2000:]
    assert outcomes["drifted"].returncode == 1
    assert f"attrs: pinned 1.0, installed {attrs_version}" in outcomes["drifted"].stdout
