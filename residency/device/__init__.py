"""How bytes reach the device and what changed there: the transports (`transport`: CPU memcpy, an
accelerator's copy stream and events; and the reused device buffer a group loads into,
`DeviceStorage`), page-locking a host mapping (`page_lock`), digests of
device bytes that say what changed since they were loaded (`digests`, whose CPU kernel is
`one_pass`: row and column sums in one read, in C), and how much host memory
the process may still take, its cgroup's limit included (`host_memory`).

No imports here: importing one module of the folder imports only what it needs."""
