"""Auto plans: the owner that measures calls and chooses a plan (`auto`), the planner's
arithmetic (`planner`), and the room a plan has on a device it shares (`room`).

No imports here: importing one module of the folder imports only what it needs."""
