"""Auto plans: the owner that measures calls and chooses a plan (`auto`), and the planner's
arithmetic (`planner`).

No imports here: importing one module of the folder imports only what it needs."""
