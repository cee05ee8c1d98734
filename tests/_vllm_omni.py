"""vLLM-Omni 0.30.0's offload-config parser, loaded by file path from its pinned wheel.

    config_module = vllm_omni_config()
    config_module.parse_diffusion_offload_config({"mode": "module", "components": ["dit"]})
    wheel_source("vllm_omni/diffusion/offloader/base.py")   # any file of the wheel, as text

The wheel is looked for in ``$RESIDENCY_TEST_CACHE`` (default ``~/.cache/residency-tests``); when
it is missing, ``python -m pip download --no-deps vllm-omni==0.30.0`` fetches it once (the package
registry is reachable on every project machine).  Its name and sha256 are checked, and only the one
module is extracted, into a temporary folder, and imported by path: vllm-omni is never installed,
so vllm is never imported.  That module imports only the standard library; `vllm_omni_config`
checks that before importing it.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile
from types import ModuleType

VERSION = "0.30.0"
WHEEL = f"vllm_omni-{VERSION}-py3-none-any.whl"
#: sha256 of the wheel PyPI serves for vllm-omni 0.30.0.
WHEEL_SHA256 = "141cb0c7b9c07970e5c92a99aab9696e81682dbfa3d2bfcde359c3c1533385f4"
#: The parser, inside the wheel.
CONFIG_MODULE = "vllm_omni/diffusion/offloader/config.py"


def cache_dir() -> pathlib.Path:
    default = pathlib.Path.home() / ".cache" / "residency-tests"
    return pathlib.Path(os.environ.get("RESIDENCY_TEST_CACHE", default))


@functools.cache
def wheel_path() -> pathlib.Path:
    """The cached, checked wheel; downloaded once when missing."""
    path = cache_dir() / WHEEL
    if not path.exists():
        _download(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise RuntimeError(
            f"{path} has sha256 {digest}, not the pinned {WHEEL_SHA256}; delete it so that the "
            "tests download vllm-omni 0.30.0 again"
        )
    return path


def _download(path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   f"vllm-omni=={VERSION}", "-d", scratch]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(
                f"could not download vllm-omni {VERSION} for the config parity tests "
                f"({' '.join(command)}):\n{result.stdout}\n{result.stderr}"
            )
        found = sorted(p.name for p in pathlib.Path(scratch).iterdir())
        if found != [WHEEL]:
            raise RuntimeError(f"pip download gave {found}, expected exactly [{WHEEL!r}]")
        os.replace(pathlib.Path(scratch) / WHEEL, path)  # atomic: no half-written wheel


def wheel_source(member: str) -> str:
    """The text of one file inside the pinned wheel."""
    with zipfile.ZipFile(wheel_path()) as wheel:
        metadata = wheel.read(f"vllm_omni-{VERSION}.dist-info/METADATA").decode()
        if f"\nVersion: {VERSION}\n" not in metadata:
            raise RuntimeError(f"{wheel_path()} is not vllm-omni {VERSION} (METADATA says otherwise)")
        return wheel.read(member).decode()


def _check_standard_library_only(source: str) -> None:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else ["<relative>"]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top != "__future__" and top not in sys.stdlib_module_names:
                raise RuntimeError(
                    f"{CONFIG_MODULE} of vllm-omni {VERSION} imports {name!r}, which is not in "
                    "the standard library; it cannot be loaded without installing vllm-omni"
                )


@functools.cache
def vllm_omni_config() -> ModuleType:
    """``vllm_omni.diffusion.offloader.config`` of 0.30.0, imported by path (once per session)."""
    source = wheel_source(CONFIG_MODULE)
    _check_standard_library_only(source)
    name = "_vllm_omni_0_30_0_offloader_config"
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "config.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is built
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return module
