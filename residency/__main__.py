"""``python -m residency``: run the quick start (replaced by the phase-timeline command)."""

import runpy
from pathlib import Path


def main() -> None:
    runpy.run_path(str(Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"),
                   run_name="__main__")


if __name__ == "__main__":
    main()
