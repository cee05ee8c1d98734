"""One group and what it owns: `Residency`, its state machine and the write-back of changed
device bytes into its master (`residency`), where each part of a group is (`plan`),
which group owns which module and tensor (`registry`), the transition records (`records`), the
calls (`calls`: where one use of the pipeline begins and ends),
checks of user input (`arguments`), and `NoOffload`, the stand-in scheduler (`no_offload`).

No imports here: importing one module of the folder imports only what it needs."""
