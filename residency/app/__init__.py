"""Built on the library, not part of it: the main job (`main`, run by ``python -m residency``),
the checks of its arguments before any work (`checks`), its synthetic pipeline (`synthetic`),
the timeline it prints (`timeline`) and plots (`plot`), and the tool that writes
docs/diffusers.md's table (`diffusers_table`).

No imports here: importing one module of the folder imports only what it needs."""
