"""The offloading engine: the shared vocabulary (`enums`, `errors`, `locks`), tensors and their
subclasses (`tensors`, `subclasses`), moving bytes (`transport`), host and device memory
(`memory`), change detection (`digests`), one group (`component`) and how its master is built
(`packing`), the owners of a scheduler's state (`holds`, `registry`, `placement`; `blocks` and
`layers` for layer mode), the records, checks of user input (`arguments`), the stand-in
`NoOffload`, and the facade (`scheduler`).

No imports here: importing one module of the folder imports only what it needs."""
