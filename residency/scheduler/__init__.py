"""The facade and the owners only it wires: `Scheduler` and its phases (`scheduler`), who may
run (`holds`) and in which order waiters go (`turns`), and how a group comes to be registered and how it leaves (`admission`).

No imports here: importing one module of the folder imports only what it needs."""
