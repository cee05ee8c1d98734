"""The shared vocabulary: a group's policy, a group's state, a phase's status.

A leaf module (it imports nothing of ours), so every layer can name these without pulling in the
layers that act on them.  The words are the glossary's (docs/design.md): *resident* always means
"its weights are on the device".
"""

from __future__ import annotations

import enum

__all__ = ["PhaseStatus", "Policy", "ResidencyState"]


class Policy(enum.Enum):
    """How the scheduler treats a group."""

    #: Swapped in by ``resident(name)``; at most one exclusive group is on the device at a time.
    EXCLUSIVE = "exclusive"
    #: Always resident: placed on the device at registration and never evicted (a VAE, shared
    #: embeddings).
    RESIDENT = "resident"


class ResidencyState(enum.Enum):
    """Where a group's weights live."""

    #: The host master is the only copy; every tensor is a view of it.  No device memory is used.
    OFFLOADED = "offloaded"
    #: Bytes are being copied into device storage; tensors still view the host master.
    LOADING = "loading"
    #: Tensors are views of device storage.  The host master still holds the bytes as loaded;
    #: changes made since are written back on eviction.
    RESIDENT = "resident"


class PhaseStatus(enum.Enum):
    """Where a `Phase` (one ``with scheduler.resident(name):`` block) is in its life."""

    #: Created, not entered yet.
    NEW = "new"
    #: Entered and not left: a frame of its thread.
    ACTIVE = "active"
    #: Left while phases inside it were still active (refused); it closes when they are left.
    LEAVING = "active (exit pending)"
    #: Left.
    EXITED = "exited"
    #: Closed by the exit of the last phase inside it, after its own exit was refused; leaving
    #: it again does nothing.
    EXITED_LATE = "exited (after the phases inside it)"
