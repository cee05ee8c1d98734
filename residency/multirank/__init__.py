"""Several ranks on one host: the node-local view of a process group (`node`), node-shared
segments (`shared_memory`), whether ranks agree on weights, phases and write-backs
(`agreement`), and sharded loads with an all-gather (`sharded`).

No imports here: importing one module of the folder imports only what it needs."""
