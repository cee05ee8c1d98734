"""Host memory: a group's persistent host master (`memory`), building
a master (`packing`), reading it from weight files (`file_reads`) or behind the first phase
(`read_behind`), the warm-restart cache (`master_cache`), and the file-backed tier for hosts
smaller than the model (`host_tier`).

No imports here: importing one module of the folder imports only what it needs."""
