"""The words everything shares and the lock: a group's policy and state and a phase's status
(`enums`), the ResidencyError family (`errors`), the scheduler's one lock and its debug check
(`locks`).  The lowest folder: it imports nothing of ours.

No imports here: importing one module of the folder imports only what it needs."""
