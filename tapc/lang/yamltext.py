"""YAML text to Python values, every failure a one-line `SpecError` naming the key.

PyYAML builds scalars with Python's own int(), float() and datetime(): a value that looks like
one but is not (`2024-13-45`, `!!int abc`, an integer of 5,000 digits) raises whatever those
raise, naming nothing. Here each is caught where its node is built and said with its key path,
line and column.
"""
from __future__ import annotations

import yaml

from tapc.errors import SpecError
from tapc.lang.quoted import shown
from tapc.lang.schema import dotted


class _Unbuilt(Exception):
    def __init__(self, node, cause: Exception):
        super().__init__(str(cause))
        self.node, self.cause = node, cause


class _Loader(yaml.SafeLoader):
    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep=deep)
        except (yaml.YAMLError, _Unbuilt, RecursionError):
            raise
        except Exception as e:   # what int(), float(), datetime() or a tag's regex raised on this scalar
            raise _Unbuilt(node, e) from None


def load_yaml(text: str, name: str):
    """The document in `text` (None when empty); `name` heads every error."""
    loader = root = None
    try:
        loader = _Loader(text)   # its reader refuses characters YAML does not allow here, at once
        root = loader.get_single_node()
        if root is not None:
            _refuse_duplicate_keys(root, name)
        return None if root is None else loader.construct_document(root)
    except _Unbuilt as e:
        raise SpecError(f"{name}: {_unbuilt(root, e)}") from None
    except yaml.YAMLError as e:
        mark, index = getattr(e, "problem_mark", None), getattr(e, "position", None)
        if mark is not None:
            where = f" (line {mark.line + 1}, column {mark.column + 1})"
        elif index is not None:   # the reader's refusals carry a character's index instead
            where = " (line {}, column {})".format(*_line_column(text, index))
        else:
            where = ""
        why = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError(f"{name}: not valid YAML{where}: {why}") from None
    except RecursionError:   # PyYAML's composer recurses once per nesting level
        raise SpecError(f"{name}: YAML nested too deep") from None
    finally:
        if loader is not None:
            loader.dispose()


def _refuse_duplicate_keys(root, name: str) -> None:
    """PyYAML keeps the last of a key given twice (a second `taps:` replaces the first, silently)."""
    stack = [root]
    seen = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:   # an alias: walked where its anchor is
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    at = first.setdefault((key.tag, key.value), key)
                    if at is not key:
                        raise SpecError(f"{name}: key `{_path(root, key).removesuffix(' (a key)')}` given twice (lines "
                                        f"{at.start_mark.line + 1} and {key.start_mark.line + 1})")
                stack.append(value)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)


def _line_column(text: str, index: int) -> tuple[int, int]:
    """1-based, as editors count."""
    before = text[:index]
    return before.count("\n") + 1, index - before.rfind("\n")


def _unbuilt(root, e: _Unbuilt) -> str:
    node, mark = e.node, e.node.start_mark
    kind = node.tag.rpartition(":")[2]   # tag:yaml.org,2002:timestamp -> timestamp
    # a ValueError says why (month must be in 1..12); the others are the constructor's internals
    why = f": {str(e.cause).split(';')[0]}" if isinstance(e.cause, ValueError) else ""
    path = _path(root, node)
    return (f"{path + ': ' if path else ''}{shown(node.value, 40)} is not a valid YAML {kind}{why} "
            f"(line {mark.line + 1}, column {mark.column + 1}; quote it to make it a string)")


def _path(root, target) -> str:
    """The key path of `target` under `root` (a node's path as `dotted` writes it)."""
    stack = [(root, ())]
    seen = set()
    while stack:
        node, parts = stack.pop()
        if node is target:
            return dotted(parts)
        if id(node) in seen:   # an alias: the node was walked where its anchor is
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else "?"
                if key is target:
                    return dotted((*parts, name, "[key]"))
                stack.append((value, (*parts, name)))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, (*parts, i)) for i, item in enumerate(node.value))
    return ""
