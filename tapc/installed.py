"""What the installed vLLM offers, read once per vLLM version and cached on disk (importing vLLM
costs seconds; `tapc explain` and spec checks stay off it), and the cache folder tapc keeps such
facts in (module trees too: tapc.plan.tree)."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import types
import typing
from pathlib import Path

from tapc import settings


def cache_dir() -> Path:
    """The folder of cached trees and names (`TAPC_CACHE`/trees)."""
    return settings.TAPC_CACHE / "trees"


def vllm_version() -> str:
    from importlib.metadata import version

    return version("vllm")


def vllm_names() -> dict[str, list[str]]:
    """Names tapc checks input against, read from the installed vLLM once per vLLM version and
    cached beside the trees (importing vLLM costs seconds; `tapc explain` stays off it):
    "engine_args", EngineArgs' fields (a spec's `engine:` keys), "engine_types", the YAML values
    each field takes (`yaml_kinds`; a field of a type YAML cannot write is left out, unchecked),
    and "architectures", the model classes vLLM has (a config's `architectures`). Empty when vLLM
    is not installed."""
    try:
        version = vllm_version()
    except Exception:  # importlib.metadata.PackageNotFoundError: no vLLM here
        return {}
    cached = cache_dir() / f"vllm-names-{version}.json"
    if cached.is_file():
        try:
            names = json.loads(cached.read_text())
        except ValueError:   # bad JSON or text: a write cut short, a disk error
            names = None
        if isinstance(names, dict) and all(isinstance(names.get(k), list) for k in ("engine_args", "architectures")):
            if isinstance(names.get("engine_types"), dict):
                return names
            # else written by a tapc before "engine_types": read again, nothing to say
        else:
            print(f"tapc: the cached vLLM names {cached} are damaged; reading them again", file=sys.stderr)
    with status("reading vLLM's engine arguments and model classes (once per vLLM version; cached)"):
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.models import ModelRegistry

        fields = dataclasses.fields(EngineArgs)
        names = {"engine_args": [f.name for f in fields],
                 "engine_types": {f.name: kinds for f in fields if (kinds := yaml_kinds(f.type)) is not None},
                 "architectures": sorted(ModelRegistry.get_supported_archs())}
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(names))
    tmp.replace(cached)
    return names


YAML_KINDS = {bool: "bool", int: "int", float: "float", str: "string", list: "list", set: "list", tuple: "list",
              dict: "dict", type(None): "null"}


def yaml_kinds(tp) -> dict | None:
    """The YAML values a field of type `tp` takes, as JSON: {"kinds": ["int", "null"], "choices":
    [a Literal's values]}; None where a part is a type YAML does not write (a config class, an
    enum, a callable, an annotation left as a string), which vLLM converts or checks itself."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        parts = [yaml_kinds(t) for t in typing.get_args(tp)]
        if any(p is None for p in parts):
            return None
        return {"kinds": sorted({k for p in parts for k in p["kinds"]}), "choices": [c for p in parts for c in p["choices"]]}
    if origin is typing.Literal:
        values = typing.get_args(tp)
        return {"kinds": [], "choices": list(values)} if all(type(v) in YAML_KINDS for v in values) else None
    kind = YAML_KINDS.get(origin or tp) if isinstance(origin or tp, type) else None
    return None if kind is None else {"kinds": [kind], "choices": []}


@contextlib.contextmanager
def status(what: str):
    """Say on stderr what a slow first step is doing: a spinner on a terminal, one line elsewhere."""
    if not sys.stderr.isatty():
        print(f"tapc: {what} ...", file=sys.stderr, flush=True)
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(f"tapc: {what}"):
        yield
