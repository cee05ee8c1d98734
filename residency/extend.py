"""Names for extending residency rather than using it: a transport of your own (how bytes
move), the completions it returns, the records' classes a tool reads, the group object
(`Residency`) that every component sits behind.

    from residency import Scheduler
    from residency.extend import CpuTransport

    class CountingTransport(CpuTransport):
        ...

    scheduler = Scheduler(transport=CountingTransport())

Users and pipeline authors need none of these: `residency.__all__` lists what they import
(these names stay importable from `residency` too, as before)."""

from residency.group.residency import Residency
from residency.group.records import BlockLog, BlockRecord, TransitionLog, TransitionRecord
from residency.device.transport import AcceleratorTransport, Completion, CpuTransport, Transport

__all__ = [
    "Residency",
    "Transport",
    "CpuTransport",
    "AcceleratorTransport",
    "Completion",
    "TransitionRecord",
    "TransitionLog",
    "BlockRecord",
    "BlockLog",
]
