"""The facade and the owners only it wires: `Scheduler` and its phases (`scheduler`), the turns
layer - who may run, in which order waiters go, and the log of their entries and waits
(`holds`) - and how a group comes to be registered and how it leaves (`admission`).

No imports here: importing one module of the folder imports only what it needs."""
