"""A model's folder: where its config.json is, and the checks on it that run before anything
imports vLLM, so that a model that is not one is said in one line naming the file and field."""
from __future__ import annotations

import json
from pathlib import Path

from tapc import paths
from tapc.errors import ResolveError
from tapc.installed import vllm_names, vllm_version


def config_path(model: str) -> Path:
    """config.json of a local directory, or of a hub id already in the local HF cache."""
    if not str(model).strip():
        raise ResolveError("the model is empty: give a directory with config.json, or a hub id")
    try:
        local = Path(model).expanduser()
    except RuntimeError:   # `~user` of a user this machine does not have
        raise ResolveError(f"{paths.shown(model)}: its `~` names no home directory on this machine") from None
    found = paths.kind(local, "model", ResolveError)
    if found == "dir":
        if paths.kind(local / "config.json", "model", ResolveError) == "file":
            return local / "config.json"
        raise ResolveError(f"{model}: a directory without config.json")
    if found is not None:
        hint = "give the folder that holds it" if local.name == "config.json" else "give a directory with config.json"
        raise ResolveError(f"{paths.shown(model)}: a file, not a model directory; {hint}")
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json")
    except Exception:  # an id that is not a valid repo name
        found = None
    if isinstance(found, str):
        return Path(found)
    raise ResolveError(f"{paths.shown(model)}: no such directory, and no config.json for it in the local Hugging Face "
                       "cache (tapc builds trees offline: give a local directory with config.json)")


MAX_CONFIG_BYTES = 4 << 20  # a config.json is a few kB; refuse to parse anything near this


def check_config(cfg: Path) -> dict:
    """config.json as a mapping that names its architecture, or a ResolveError naming the file and field.
    Cheap: runs before anything imports vLLM."""
    if cfg.stat().st_size > MAX_CONFIG_BYTES:
        raise ResolveError(f"{cfg}: {cfg.stat().st_size} bytes, too large for a model config (at most {MAX_CONFIG_BYTES})")
    try:
        data = json.loads(cfg.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" (line {e.lineno}, column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise ResolveError(f"{cfg}: not valid JSON{where}: {getattr(e, 'msg', e)}") from None
    if not isinstance(data, dict):
        raise ResolveError(f"{cfg}: a model config is a JSON object, not {type(data).__name__}")
    archs = data.get("architectures")
    if not (isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs)):
        raise ResolveError(f"{cfg}: field `architectures` is {'missing' if archs is None else repr(archs)}; it names "
                           'the model class vLLM builds, e.g. "architectures": ["LlamaForCausalLM"]')
    return data


def check_architecture(cfg: Path, archs: list[str]) -> None:
    """An architecture vLLM has no model class for, said in one line (vLLM's own error is a page)."""
    supported = vllm_names().get("architectures")
    if supported and not any(a in supported for a in archs):
        import difflib

        near = difflib.get_close_matches(archs[0], supported, n=3)
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        raise ResolveError(f"{cfg}: field `architectures` is {archs}: vLLM {vllm_version()} has no model class "
                           f"for {'it' if len(archs) == 1 else 'them'}{hint}")
