"""What we know about a user's modules and tensors: where each tensor is and who may view its
storage (`tensors`), tensor subclasses flattened into their inner tensors (`subclasses`), which
blocks a model streams in layer mode (`blocks`), and per-instance wrappers of a module's
methods (`instance_wrappers`).

No imports here: importing one module of the folder imports only what it needs."""
