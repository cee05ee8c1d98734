"""What each component of a diffusers pipeline is, from its name, class and offload metadata.

    from residency.adapters.diffusers_roles import roles_of

    for name, role in roles_of(pipe).items():
        print(name, role.kind, role.joins, role.why)     # "unet dit - named like a denoiser"

No per-pipeline code: the rules read the component's name, the package its class comes from, and
the pipeline's own offload metadata, ``model_cpu_offload_seq`` (the order diffusers' model offload
runs the components in) and ``_exclude_from_cpu_offload`` (what it keeps on the device).  The first
rule that matches decides:

1. named like a denoiser — ``transformer``, ``unet``, ``prior`` with any prefix and a ``_N``
   suffix (``transformer_2``, ``prior_prior``, ``image_unet``), or ``decoder`` — is ``dit``;
2. named like a step companion — ``controlnet``, ``adapter`` (``motion_adapter``) — joins the
   group of the denoiser next to it in ``model_cpu_offload_seq`` (``companion``);
3. named like an encoder — ``*encoder``, ``*embedder``, ``*feature_extractor`` — is ``encoder``;
4. named like a VAE — ``vae``, ``vqvae``, ``movq``, ``vqgan``, ``vocoder`` (``audio_vae``) — is
   ``vae``;
5. a diffusers model class from ``diffusers.models.unets`` / ``.transformers`` is ``dit``, from
   ``.controlnets`` a ``companion``, from ``.autoencoders`` a ``vae``;
6. listed in ``_exclude_from_cpu_offload``: ``resident`` (diffusers keeps it on the device too);
7. in ``model_cpu_offload_seq`` before the first denoiser: ``encoder``; after the last: ``vae``;
   between two: a ``companion`` of the one before it;
8. anything else is ``resident``: it stays on the device (the adapter names these in one log
   line), since nothing says when it runs.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Collection, Mapping, Sequence

import attrs
from torch import nn

__all__ = ["KINDS", "Role", "classify", "roles_of", "roles_of_class"]

#: The kinds a component can be, in the order tables show them.
KINDS = ("dit", "companion", "encoder", "vae", "resident")

_NAMED = (
    (re.compile(r"(\w+_)?(transformer|unet|prior)(_\d+)?|decoder(_\d+)?"), "dit",
     "named like a denoiser"),
    (re.compile(r"(\w+_)?(controlnet|adapter)(_\d+)?"), "companion", "named like a step companion"),
    (re.compile(r"(\w+_)?(encoder|embedder|feature_extractor)(_\d+)?"), "encoder",
     "named like an encoder"),
    (re.compile(r"(\w+_)?(vae|vqvae|movq|vqgan|vocoder)(_\d+)?"), "vae", "named like a VAE"),
)
_FAMILIES = (
    ("diffusers.models.unets.", "dit"),
    ("diffusers.models.transformers.", "dit"),
    ("diffusers.models.controlnets.", "companion"),
    ("diffusers.models.autoencoders.", "vae"),
)


@attrs.frozen
class Role:
    """How one component is offloaded: its kind, the denoiser it joins, and which rule said so.

        Role("controlnet", "companion", joins="unet", why="named like a step companion")
    """

    #: The component's name in the pipeline.
    name: str
    #: One of `KINDS`: "dit", "companion", "encoder", "vae" or "resident".
    kind: str
    #: For a companion: the denoiser whose group it joins; else None.
    joins: str | None = None
    #: The rule that decided, in words.
    why: str = ""


def classify(
    names: Sequence[str],
    *,
    seq: Sequence[str] = (),
    excluded: Collection[str] = (),
    families: Mapping[str, str] = {},
) -> dict[str, Role]:
    """The `Role` of each module component in `names` (in that order), by the module's rules.

        classify(["text_encoder", "unet", "controlnet", "vae"],
                 seq=["text_encoder", "unet", "vae"])["controlnet"].joins      # "unet"

    `seq` is ``model_cpu_offload_seq`` split at "->", `excluded` ``_exclude_from_cpu_offload``,
    `families` maps a name to the module its class is defined in (rule 5).
    """
    first = {name: _first_pass(name, excluded, families.get(name, "")) for name in names}
    denoisers = [name for name in names if first[name] is not None and first[name][0] == "dit"]
    roles = {}
    for name in names:
        kind, why = first[name] or _by_sequence(name, seq, denoisers)
        joins = _denoiser_for(name, seq, denoisers) if kind == "companion" else None
        if kind == "companion" and joins is None:
            kind, why = "resident", f"{why}, with no denoiser to join"
        roles[name] = Role(name, kind, joins, why)
    return roles


def _first_pass(name: str, excluded: Collection[str], family: str) -> tuple[str, str] | None:
    """Rules 1-6: the name, the class's package, the exclusion list."""
    for pattern, kind, why in _NAMED:
        if pattern.fullmatch(name):
            return kind, why
    for prefix, kind in _FAMILIES:
        if family.startswith(prefix):
            return kind, f"a {prefix.rstrip('.')} class"
    if name in excluded:
        return "resident", "in _exclude_from_cpu_offload"
    return None


def _by_sequence(name: str, seq: Sequence[str], denoisers: Sequence[str]) -> tuple[str, str]:
    """Rules 7 and 8: where `name` runs in ``model_cpu_offload_seq``, relative to the denoisers."""
    places = [seq.index(d) for d in denoisers if d in seq]
    if name not in seq or not places:
        return "resident", "nothing says when it runs"
    place = seq.index(name)
    if place < min(places):
        return "encoder", "before the denoiser in model_cpu_offload_seq"
    if place > max(places):
        return "vae", "after the denoiser in model_cpu_offload_seq"
    return "companion", "between denoisers in model_cpu_offload_seq"


def _denoiser_for(name: str, seq: Sequence[str], denoisers: Sequence[str]) -> str | None:
    """The denoiser a companion joins: the next one in `seq`, else the one before, else the
    first one in `seq`, else the first one."""
    in_seq = [d for d in seq if d in denoisers]
    if name in seq:
        place = seq.index(name)
        after = [d for d in in_seq if seq.index(d) > place]
        before = [d for d in in_seq if seq.index(d) < place]
        if after or before:
            return (after or before[::-1])[0]
    return (in_seq or list(denoisers) or [None])[0]


def _metadata(cls: type) -> tuple[list[str], list[str]]:
    seq = getattr(cls, "model_cpu_offload_seq", None) or ""
    return [part for part in seq.split("->") if part], list(
        getattr(cls, "_exclude_from_cpu_offload", ()) or ()
    )


def roles_of(pipe: object, components: Mapping[str, nn.Module] | None = None) -> dict[str, Role]:
    """The `Role` of each module component of a diffusers pipeline instance.

        roles_of(sdxl)["unet"].kind            # "dit"

    `components` (name -> module) defaults to the modules in ``pipe.components``.
    """
    if components is None:
        components = {name: part for name, part in pipe.components.items()
                      if isinstance(part, nn.Module)}
    seq, excluded = _metadata(type(pipe))
    families = {name: type(module).__module__ for name, module in components.items()}
    return classify(list(components), seq=seq, excluded=excluded, families=families)


def roles_of_class(cls: type) -> dict[str, Role]:
    """The `Role` of each module component a pipeline class declares, without building it.

        roles_of_class(StableDiffusionXLPipeline)["text_encoder_2"].kind    # "encoder"

    A parameter of ``__init__`` is a module component when its annotation names an
    ``nn.Module`` class, or, when the annotation says nothing (``Any``), when the offload
    metadata lists it.
    """
    seq, excluded = _metadata(cls)
    modules: dict[str, str] = {}
    for name, parameter in inspect.signature(cls.__init__).parameters.items():
        classes = _annotated_classes(parameter.annotation)
        module_classes = [c for c in classes if issubclass(c, nn.Module)]
        if module_classes:
            modules[name] = module_classes[0].__module__
        elif not classes and (name in seq or name in excluded):
            modules[name] = ""
    return classify(list(modules), seq=seq, excluded=excluded, families=modules)


def _annotated_classes(annotation: object) -> list[type]:
    """The classes an annotation names (through unions, Optional, list[...] and tuple[...])."""
    if isinstance(annotation, type) and not isinstance(annotation, types.GenericAlias):
        return [annotation]
    found = []
    for argument in typing.get_args(annotation):
        found.extend(_annotated_classes(argument))
    return found
