"""``python -m residency``: the main job, whose code is `residency.app.main`.

    python -m residency --size small --steps 2

Kept at this path so the command and its flags keep working."""

import sys

from residency.app.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
