"""The old import path of `residency.engine.transport`, kept for code written against the
flat layout (issue 21):

    from residency.transport import AcceleratorTransport

New code imports from `residency.engine.transport`."""

from residency.engine.transport import (
    AcceleratorTransport,
    Completion,
    CpuTransport,
    Transport,
    transport_for,
)

__all__ = ["AcceleratorTransport", "Completion", "CpuTransport", "Transport", "transport_for"]
