"""The table in docs/diffusers.md: every installed diffusers pipeline with ``model_cpu_offload_seq``.

    python -m residency.app.diffusers_table > table.md     # or: table() as a string

Each row: the pipeline class, how `roles_of_class` classifies its module components (from the
class's ``__init__`` signature and offload metadata, nothing instantiated), and whether the suite
builds it tiny and runs it (`TESTED`), else why not.  ``tests/test_diffusers_table.py`` checks
that the committed table is what this module generates from the installed diffusers.
"""

from __future__ import annotations

import inspect

from residency.adapters.diffusers_roles import KINDS, Role, roles_of_class

__all__ = ["TESTED", "pipeline_classes", "table"]

#: Pipeline class -> the test that builds it tiny and checks it bit-identical, call by call.
TESTED = {
    "StableDiffusionXLPipeline": "test_diffusers_families.py",
    "StableDiffusionControlNetPipeline": "test_diffusers_families.py",
    "StableDiffusionPipeline": "test_diffusers_families.py (IP-Adapter)",
    "AnimateDiffPipeline": "test_diffusers_families.py",
    "KandinskyV22CombinedPipeline": "test_diffusers_families.py",
    "WanPipeline": "test_diffusers_adapter.py",
    "FluxPipeline": "test_diffusers_adapter.py, test_diffusers_machinery.py",
}


def pipeline_classes() -> list[type]:
    """Every pipeline class diffusers exports that declares ``model_cpu_offload_seq``, by name."""
    import diffusers

    found = {}
    for name in dir(diffusers):
        if not name.endswith("Pipeline"):
            continue
        try:
            cls = getattr(diffusers, name)
        except (ImportError, AttributeError, RuntimeError):
            continue  # an optional backend diffusers cannot load here
        if (inspect.isclass(cls) and issubclass(cls, diffusers.DiffusionPipeline)
                and getattr(cls, "model_cpu_offload_seq", None)):
            found[cls.__name__] = cls
    return [found[name] for name in sorted(found)]


def _cell(roles: list[Role]) -> str:
    return ", ".join(
        f"{role.name} → {role.joins}" if role.joins else role.name for role in roles
    ) or "—"


def _tested(cls: type, roles: dict[str, Role], tested_shapes: dict[tuple, str]) -> str:
    if cls.__name__ in TESTED:
        return f"yes: {TESTED[cls.__name__]}"
    kinds = {role.kind for role in roles.values()}
    if not kinds & {"dit", "encoder"}:
        return "no: nothing the default config selects (select 'vae')"
    shape = _shape(roles)
    if shape in tested_shapes:
        return f"no: same roles as {tested_shapes[shape]}"
    return "no: not built tiny here"


def _shape(roles: dict[str, Role]) -> tuple:
    return tuple(sorted((role.name, role.kind, role.joins or "") for role in roles.values()))


def table() -> str:
    """The markdown table, one row per pipeline class (see the module docstring)."""
    classes = pipeline_classes()
    all_roles = {cls: roles_of_class(cls) for cls in classes}
    tested_shapes = {_shape(all_roles[cls]): cls.__name__ for cls in classes
                     if cls.__name__ in TESTED}
    header = ["pipeline", *KINDS, "tested here"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cls in classes:
        roles = all_roles[cls]
        cells = [_cell([r for r in roles.values() if r.kind == kind]) for kind in KINDS]
        lines.append("| " + " | ".join(
            [f"`{cls.__name__}`", *cells, _tested(cls, roles, tested_shapes)]) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(), end="")
