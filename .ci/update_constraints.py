"""Move the pinned set forward: resolve the project's extras afresh, run the suite against that
set, and rewrite constraints.txt only when the suite passed.

    .ci/update-constraints                         # a throw-away venv, resolved without pins
    .ci/update-constraints --freeze FREEZE.txt --suite "python -c pass"   # dry: nothing installed

The suite runs with ``RESIDENCY_CONSTRAINTS`` naming the new set, so that
tests/test_installed_versions.py compares what is installed with the set being tried, not with
the old constraints.txt (which any newer release would contradict).  ``--freeze FILE`` stands in
for the resolver (a ``pip freeze`` listing): no venv is made, nothing is installed or downloaded,
and the suite runs in the current environment; tests/test_update_constraints.py runs it so.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = "test,diffusers,peers,plot,quant,serve"
#: The header lines of constraints.txt (comments) kept above the pins.
HEADER_LINES = 3
#: The CPU torch build's local version tag, dropped from the pin (the README pins torch==X).
_LOCAL_CPU = re.compile(r"^torch==([0-9][0-9.]*)\+cpu$")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.freeze is not None and not args.freeze.is_file():
        _parser().error(f"--freeze {args.freeze}: no such file; give a `pip freeze` listing")
    if not args.constraints.is_file():
        _parser().error(f"--constraints {args.constraints}: no such file")
    with tempfile.TemporaryDirectory(prefix="update-constraints-") as scratch:
        scratch = Path(scratch)
        if args.freeze is None:
            python = _resolve_afresh(scratch / "venv")
            frozen = _freeze(python)
        else:
            python, frozen = Path(sys.executable), args.freeze.read_text()
        proposed = scratch / "constraints.txt"
        proposed.write_text(constraints_text(args.constraints.read_text(), frozen))
        suite = shlex.split(args.suite) if args.suite else [str(python), "-m", "pytest", "-q",
                                                            "-p", "no:cacheprovider"]
        done = subprocess.run(suite, cwd=ROOT, env=_suite_env(python, proposed), check=False)
        if done.returncode != 0:
            print(f"update-constraints: the suite failed against the new set (exit "
                  f"{done.returncode}); {args.constraints} is unchanged", file=sys.stderr)
            return 1
        args.constraints.write_text(proposed.read_text())
    print(f"update-constraints: {args.constraints} rewritten from a green run; review "
          f"'git diff {args.constraints.name}' and commit it")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=".ci/update-constraints", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--freeze", type=Path, metavar="FILE", default=None,
                        help="a pip freeze listing that stands in for the resolver (dry mode: "
                        "no venv, nothing installed)")
    parser.add_argument("--suite", metavar="COMMAND", default=None,
                        help="the command run against the new set (default: the whole suite)")
    parser.add_argument("--constraints", type=Path, metavar="FILE",
                        default=ROOT / "constraints.txt", help="the file to rewrite")
    return parser


def constraints_text(old: str, frozen: str) -> str:
    """The old file's header, then one ``name==version`` per frozen line, sorted as pip freeze
    sorts them: editable installs, comments and the CPU torch build's ``+cpu`` tag left out.

        constraints_text(old, "torch==2.14.0+cpu\\nattrs==26.1.0\\n")   # header, attrs, torch
    """
    header = old.splitlines()[:HEADER_LINES]
    pins = []
    for line in frozen.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "-e ")) or "==" not in line:
            continue
        pins.append(_LOCAL_CPU.sub(r"torch==\1", line))
    return "\n".join([*header, *sorted(pins, key=str.lower)]) + "\n"


def _resolve_afresh(where: Path) -> Path:
    """A venv with the project's extras resolved without constraints; returns its python."""
    venv.create(where, with_pip=True)
    python = where / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)  # the CPU build on the project's disk
    subprocess.run([*pip, "-e", f".[{EXTRAS}]"], cwd=ROOT, check=True)
    return python


def _freeze(python: Path) -> str:
    return subprocess.run([str(python), "-m", "pip", "freeze", "--exclude-editable"], check=True,
                          capture_output=True, text=True).stdout


def _suite_env(python: Path, proposed: Path) -> dict[str, str]:
    env = dict(os.environ, RESIDENCY_CONSTRAINTS=str(proposed))
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    return env


if __name__ == "__main__":
    sys.exit(main())
