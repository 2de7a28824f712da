"""Tap text -> tap AST (frozen dataclasses). Every parse error is a `TapSyntaxError`.

A tap is one line: a point, then optionally an action (`| op(args)` or `-> block`).
The grammar is data (`tapc/lang/taps.lark`); this module turns its trees into plain values and
translates Lark's errors into the tap's own terms. docs/dsl.md is the user's guide.
"""
from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Iterable, Union

import lark
from lark import Lark, Transformer

from tapc.errors import PlanError, TapSyntaxError
from tapc.lang.edits import (AT, CALL, LENS, LENS_K, MAX_LENS_K, MAX_PATTERN_KEYS, PATTERN, PATTERN_ARGS, REQUIRED,
                             SIGNATURES, check_literal)

# ----------------------------------------------------------------------------- the AST


@dataclass(frozen=True)
class Star:
    """`*`: every child of the module at that point of the path."""


@dataclass(frozen=True)
class Slice:
    """`[start:stop:step]` over numbered children (a ModuleList), Python semantics."""

    start: int | None = None
    stop: int | None = None
    step: int | None = None


@dataclass(frozen=True)
class Pick:
    """`[1,5,9]`: these numbered children, in this order."""

    indices: tuple[int, ...]


Segment = Union[str, Star, Slice, Pick]


@dataclass(frozen=True)
class Param:
    """A name in an argument list: a parameter bound per request or per engine."""

    name: str


Value = Union[float, int, str, tuple, Param]


@dataclass(frozen=True)
class Action:
    """What to do at the point. op "capture" (the default), an edit, "call" or "block"."""

    op: str = "capture"
    args: tuple[tuple[str, Value], ...] = ()  # (argument name, value), defaults filled in
    block: str | None = None                   # the Python block's name for `-> name`
    function: str | None = None                # the compiled function's name for `| call(name, ...)`


@dataclass(frozen=True)
class TapSpec:
    """One parsed tap, before it meets a model."""

    text: str                     # the tap as written (comment stripped)
    path: tuple[Segment, ...] = ()
    site: str = "output"          # output | input | resid | pattern | source | logits | samples
    op: str | None = None         # `.source` op name
    io: str = "output"            # `.source.<op>.output|input`
    element: int | None = None
    action: Action = Action()
    line: int = 1                 # line in the spec the tap came from

    @property
    def is_engine_point(self) -> bool:
        return self.site in ("logits", "samples")


# ----------------------------------------------------------------------------- edit signatures

# op -> ((argument, kind, default), ...) is tapc/lang/edits.py's SIGNATURES; every edit also takes `at=` (AT).
# `call(name, p=value, ...)` runs a compiled function (tapc/lang/functions.py): its parameters
# are the function's, so only the plan, which has the function, checks them.
# `lens(k=10)` reads the point through the model's final norm and unembedding: the plan makes
# it two captures, `<point>:lens.ids` and `<point>:lens.logits`.
ACTIONS = ("capture", *SIGNATURES, CALL, LENS)


# ----------------------------------------------------------------------------- limits

# Checked on the text before Lark sees it: the parser's tree walk recurses once per path segment
# and per list level, and Python refuses integers of more than 4300 digits. Real taps are far
# inside these (docs/dsl.md says them).
MAX_TAP_CHARS = 2000      # characters in one tap
MAX_SEGMENTS = 64         # `.`-separated parts of a point
MAX_NESTING = 8           # `[` inside `[`
MAX_DIGITS = 18           # digits of an integer (and of a float's integer part before its exponent)
SITES = ("output", "input", "resid", "pattern", "source")  # the words that end a module point


# ----------------------------------------------------------------------------- parsing


@lru_cache(maxsize=1)
def _parser() -> Lark:
    grammar = resources.files("tapc.lang").joinpath("taps.lark").read_text()
    # cache=True: Lark keeps the built parser in the temp folder, keyed by grammar and options;
    # building it anew (its lexer's regex-collision check) costs about a second every process
    return Lark(grammar, start="tap", parser="lalr", propagate_positions=True, cache=True)


class _ToAst(Transformer):
    """One method per grammar rule; returns plain values."""

    # path segments
    def named(self, items):
        name, *sel = items
        return [str(name), *sel]

    def index(self, items):
        return [str(items[0])]

    def star(self, _):
        return [Star()]

    def selected(self, items):
        return [items[0]]

    def selector(self, items):
        return items[0]

    def slice(self, items):
        # already a Slice: parse_tap rebuilds slice nodes from their tokens (_slice_from_tree)
        return items[0]

    def pick(self, items):
        return Pick(tuple(int(i) for i in items))

    def element(self, items):
        return int(items[0])

    # sites
    def output(self, items):
        return {"site": "output", "element": items[1] if len(items) > 1 else None}

    def input(self, items):
        return {"site": "input", "element": items[1] if len(items) > 1 else None}

    def resid(self, _):
        return {"site": "resid"}

    def pattern(self, _):
        return {"site": PATTERN}

    def source(self, items):
        _, op, io, *element = items
        return {"site": "source", "op": str(op), "io": str(io), "element": element[0] if element else None}

    def step(self, items):
        segment, tail = items
        return {**tail, "path": segment + tail.get("path", [])}

    def point(self, items):
        segment, tail = items
        tail = tail if "path" in tail else {**tail, "path": []}
        return {**tail, "path": tuple(segment + tail["path"])}

    def logits(self, _):
        return {"site": "logits", "path": ()}

    def samples(self, _):
        return {"site": "samples", "path": ()}

    # actions
    def number(self, items):
        text = str(items[0])
        return int(text) if text.lstrip("+-").isdigit() else float(text)  # finite: _check_numbers

    def name(self, items):
        return Param(str(items[0]))

    def list(self, items):
        return tuple(i for i in items if i is not None)

    def arg(self, items):
        return (str(items[0]), items[1]) if len(items) == 2 else (None, items[0])

    def call(self, items):
        return ("call", items[0], [a for a in items[1:] if a is not None])

    def block(self, items):
        return ("block", items[0], [])

    def tap(self, items):
        point = items[0]
        action = items[1] if len(items) > 1 else ("call", None, [])
        return point, action


# Lark builds `slice` children without placeholders for absent INTs; rebuild from the text.
def _slice_from_tree(tree: lark.Tree) -> Slice:
    parts: list[int | None] = [None, None, None]
    k = 0
    for child in tree.children:
        if isinstance(child, lark.Token) and child.type == "SINT":
            parts[k] = int(child)
        elif isinstance(child, lark.Token):
            k += 1
    return Slice(*parts)


_TERMINAL_WORDS = {
    "NAME": "a name", "INT": "a number", "SINT": "a number", "STAR": "`*`", "DOT": "`.`", "LSQB": "`[`",
    "RSQB": "`]`", "LPAR": "`(`", "RPAR": "`)`", "COMMA": "`,`", "COLON": "`:`",
    "VBAR": "`|` and an action", "__ANON_0": "`->` and a block name", "EQUAL": "`=`",
    "SIGNED_NUMBER": "a number", "OUTPUT": "`output`", "INPUT": "`input`", "RESID": "`resid`",
    "SOURCE": "`source`", "PATTERN": "`pattern`", "LOGITS": "`logits`", "SAMPLES": "`samples`", "$END": "the end of the tap",
    "<END-OF-FILE>": "the end of the tap",  # how Lark's lexer names $END when it stops at a token
}


def _expected(terminals: Iterable[str]) -> str:
    words = sorted({_TERMINAL_WORDS.get(t, t) for t in terminals})
    return ", ".join(words[:-1]) + (" or " if len(words) > 1 else "") + words[-1] if words else "nothing"


def _syntax_error(text: str, column: int, what: str, where: str) -> TapSyntaxError:
    """`where` is "" or a place in a longer input, e.g. "line 3, "."""
    caret = " " * (column - 1) + "^"
    return TapSyntaxError(f"{what} ({where}column {column})\n  {text}\n  {caret}", text, column)


def _explain_unexpected(e: lark.UnexpectedInput, text: str) -> str:
    if isinstance(e, lark.UnexpectedCharacters):
        got = f"unexpected character {text[e.pos_in_stream]!r}"
        expected = getattr(e, "allowed", None) or ()
    elif isinstance(e, lark.UnexpectedToken):
        tok = e.token
        got = "the tap ends too early" if tok.type == "$END" else f"unexpected {str(tok)!r}"
        expected = e.expected
    else:  # UnexpectedEOF
        got, expected = "the tap ends too early", getattr(e, "expected", ())
    if not text.strip():
        return "empty tap"
    return f"{got}: expected {_expected(expected)}"


def _check_size(text: str, where: str) -> None:
    """The limits above, on the raw text (before Lark, whose tree walk recurses per level)."""
    if len(text) > MAX_TAP_CHARS:
        raise TapSyntaxError(f"a tap of {len(text)} characters; taps are at most {MAX_TAP_CHARS} "
                             f"({where or ''}starts {text[:40]!r})", text[:80])
    point = re.split(r"\||->", text, maxsplit=1)[0]
    if point.count(".") >= MAX_SEGMENTS:
        raise _syntax_error(text[:80], 1, f"a point of {point.count('.') + 1} parts; a point has at most "
                            f"{MAX_SEGMENTS}", where)
    depth = 0
    for col, ch in enumerate(text, start=1):
        depth += (ch == "[") - (ch == "]")
        if depth > MAX_NESTING:
            raise _syntax_error(text[:col], col, f"brackets nested more than {MAX_NESTING} deep", where)


def _check_numbers(tree: lark.Tree, text: str, where: str) -> None:
    """Integers of at most MAX_DIGITS digits, floats finite (`1e999` is inf)."""
    for tok in tree.scan_values(lambda v: isinstance(v, lark.Token)):
        if tok.type not in ("INT", "SINT", "SIGNED_NUMBER"):
            continue
        mantissa = re.split(r"[.eE]", tok.lstrip("+-"), maxsplit=1)[0]
        if len(mantissa) > MAX_DIGITS:
            raise _syntax_error(text, tok.column, f"a number of {len(mantissa)} digits; numbers have at most "
                                f"{MAX_DIGITS}", where)
        if tok.type == "SIGNED_NUMBER" and not math.isfinite(float(tok)):
            raise _syntax_error(text, tok.column, f"{str(tok)!r} is not a finite number", where)


def parse_tap(text: str, line: int = 1, unit: str = "line") -> TapSpec:
    """Parse one tap. Raises TapSyntaxError with the tap, a caret and what was expected.

    `line`/`unit` place the tap in a longer input for messages: "line 3" of a text, "entry 2" of a list.
    """
    raw = text
    where = f"{unit} {line}, " if line > 1 else ""
    _check_size(text, where)
    text = text.split("#", 1)[0].rstrip()
    if not text.strip():
        raise _syntax_error(raw, 1, "empty tap", where)
    try:
        tree = _parser().parse(text)
    except lark.UnexpectedInput as e:
        column = getattr(e, "column", None)
        at_end = isinstance(e, lark.UnexpectedEOF) or isinstance(e, lark.UnexpectedToken) and e.token.type == "$END"
        column = column if isinstance(column, int) and column > 0 and not at_end else len(text) + 1
        raise _syntax_error(text, column, _explain_unexpected(e, text) + _point_word_hint(text, at_end), where) from None
    _check_numbers(tree, text, where)
    for sub in tree.iter_subtrees():
        if sub.data == "slice":
            sub.children = [_slice_from_tree(sub)]
    point, (kind, name, args) = _ToAst().transform(tree)
    if kind == "block":
        action = Action(op="block", block=str(name))
    else:
        action = _bind_action(text, None if name is None else str(name), args, where, point.get("site"))
    return TapSpec(text=text.strip(), action=action, line=line, **point)


def _point_word_hint(text: str, at_end: bool) -> str:
    """`model.layers.*.outptu` -> "; did you mean `model.layers.*.output`?" (a near miss of a site
    word); a point that stops before its site word is told the words."""
    point, *action = re.split(r"\||->", text, maxsplit=1)
    head, dot, last = point.rstrip().rpartition(".")
    word = re.match(r"[A-Za-z_]\w*", last)
    if dot and word is not None and word.group() not in SITES:
        near = difflib.get_close_matches(word.group(), SITES, n=1, cutoff=0.6)
        if near:
            return f"; did you mean `{head}.{near[0]}{last[word.end():]}`?"
    if at_end and not action and "source" not in point and not point.rstrip().endswith("."):
        return "; a module point ends in `.output`, `.input`, `.resid` or `.source.<op>.output`"
    return ""


def _bind_action(text: str, op: str | None, args: list, where: str, site: str | None = None) -> Action:
    """Check an action call against its signature; fill in defaults."""
    if op is None or op == "capture":
        if site == PATTERN:
            return _bind_pattern(text, args, where)
        if args:
            raise _syntax_error(text, text.index("capture") + 1, "capture takes no arguments (but at an attention's "
                                "`.pattern`: heads, keys)", where)
        return Action()
    if op == CALL:
        return _bind_call(text, args, where)
    if op == LENS:
        return _bind_lens(text, args, where)
    if op not in SIGNATURES:
        col = text.rindex("|") + 2
        near = difflib.get_close_matches(op, ACTIONS, n=1, cutoff=0.6)
        hint = f"did you mean `{near[0]}`? " if near else ""
        raise _syntax_error(text, col, f"unknown action {op!r}: {hint}the actions are {', '.join(ACTIONS)}, "
                            "or `-> name` for a Python block", where)
    signature = SIGNATURES[op] + (AT,)
    names = [a for a, _, _ in signature]
    bound: dict[str, Value] = {}
    for i, (name, value) in enumerate(args):
        if name is None:
            if bound and any(n is not None for n, _ in args[:i]):
                raise _syntax_error(text, len(text), f"{op}(): a positional argument follows a named one", where)
            if i >= len(SIGNATURES[op]):
                raise _syntax_error(text, len(text), f"{op}() takes {len(SIGNATURES[op])} positional "
                                    f"argument(s): {', '.join(names)}", where)
            name = names[i]
        if name not in names:
            raise _syntax_error(text, text.index(name) + 1,
                                f"{op}() has no argument {name!r}; it takes {', '.join(names)}", where)
        if name in bound:
            raise _syntax_error(text, len(text), f"{op}(): argument {name!r} given twice", where)
        bound[name] = value
    out = []
    for name, kind, default in signature:
        if name not in bound:
            if default is REQUIRED:
                raise _syntax_error(text, len(text), f"{op}() needs its argument {name!r} "
                                    f"({op}({', '.join(n for n, _, d in signature if d is REQUIRED)}))", where)
            value: Value = default  # type: ignore[assignment]
        else:
            value = _check_value(text, op, name, kind, bound[name], where)
        out.append((name, value))
    return Action(op=op, args=tuple(out))


def _bind_call(text: str, args: list, where: str) -> Action:
    """`call(name, p=value, ..., at=...)`: the function's name, then its parameters by name."""
    if not args or args[0][0] is not None or not isinstance(args[0][1], Param):
        raise _syntax_error(text, len(text), "call() names the compiled function first: `call(name, param=value, ...)`",
                            where)
    bound: dict[str, Value] = {}
    for name, value in args[1:]:
        if name is None:
            raise _syntax_error(text, len(text), "call(): give the function's parameters by name "
                                "(`call(name, threshold=t)`)", where)
        if name in bound:
            raise _syntax_error(text, len(text), f"call(): argument {name!r} given twice", where)
        if name == AT[0]:
            value = _check_value(text, CALL, name, AT[1], value, where)
        elif isinstance(value, tuple) and not all(isinstance(v, (int, float)) for v in value):
            raise _syntax_error(text, len(text), f"call(): argument {name!r} must be a number, a list of numbers "
                                "or a parameter name", where)
        bound[name] = value
    bound.setdefault(AT[0], AT[2])
    return Action(op=CALL, args=tuple(bound.items()), function=args[0][1].name)


def _bind_lens(text: str, args: list, where: str) -> Action:
    """`lens(k)` or `lens(k=10)`: how many of the best tokens each row keeps."""
    name, default = LENS_K
    if len(args) > 1 or args and args[0][0] not in (None, name):
        raise _syntax_error(text, len(text), f"lens() takes one argument, {name} (the tokens a row keeps): "
                            f"`lens({name}={default})`", where)
    k = args[0][1] if args else default
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_LENS_K:
        raise _syntax_error(text, len(text), f"lens(): {name} must be a whole number in 1..{MAX_LENS_K}, not "
                            f"{k.name if isinstance(k, Param) else k!r}", where)
    return Action(op=LENS, args=((name, k),))


def _bind_pattern(text: str, args: list, where: str) -> Action:
    """`capture(heads=[0, 5], keys=512)` at a `.pattern`: the heads kept (default: all) and the
    keys a row holds (default: the engine's max_model_len), both by name; what is not given is
    left out, for the plan to fill in."""
    bound = {}
    for name, value in args:
        if name not in PATTERN_ARGS:
            raise _syntax_error(text, len(text), f"capture() at a `.pattern` takes {' and '.join(PATTERN_ARGS)}, by "
                                f"name (`capture(heads=[0, 5], keys=512)`), not {name or 'a positional argument'}",
                                where)
        if name in bound:
            raise _syntax_error(text, len(text), f"capture(): argument {name!r} given twice", where)
        heads = value if isinstance(value, tuple) else None
        if name == "heads" and not (heads and all(isinstance(h, int) and not isinstance(h, bool) and 0 <= h
                                                   for h in heads) and len(set(heads)) == len(heads)):
            raise _syntax_error(text, len(text), f"capture(): heads must be a list of distinct head numbers (0 "
                                f"and up), e.g. [0, 5], not {_shown(value)}", where)
        if name == "keys" and (isinstance(value, bool) or not isinstance(value, int)
                               or not 1 <= value <= MAX_PATTERN_KEYS):
            raise _syntax_error(text, len(text), f"capture(): keys must be a whole number in 1..{MAX_PATTERN_KEYS} "
                                f"(the keys a row holds), not {_shown(value)}", where)
        bound[name] = value
    return Action(args=tuple((name, bound[name]) for name in PATTERN_ARGS if name in bound))


def _shown(value) -> str:
    return value.name if isinstance(value, Param) else repr(value)


def _check_value(text: str, op: str, name: str, kind: str, value: Value, where: str) -> Value:
    if kind == "positions":   # a keyword, parsed as a name
        value = value.name if isinstance(value, Param) else value
    elif isinstance(value, Param) and kind == "count":
        raise _syntax_error(text, len(text), f"{op}(): argument {name!r} sizes the engine's tables: give a number, "
                            f"not the parameter {value.name!r}", where)
    elif isinstance(value, Param):
        return value
    try:
        return check_literal(kind, value)
    except ValueError as e:
        raise _syntax_error(text, len(text), f"{op}(): argument {name!r} {e}", where) from None


def parse_taps(lines: str | Iterable[str]) -> tuple[TapSpec, ...]:
    """Parse many taps: a text (one per line, `#` comments, blank lines) or a list of strings."""
    items = lines.splitlines() if isinstance(lines, str) else list(lines)
    taps = []
    for n, item in enumerate(items, start=1):
        if not isinstance(item, str):
            raise TapSyntaxError(f"tap {n} is a {type(item).__name__}, not a string: {item!r}", repr(item))
        if item.split("#", 1)[0].strip():
            taps.append(parse_tap(item, line=n, unit="line" if isinstance(lines, str) else "entry"))
    return taps_without_duplicates(taps, "lines" if isinstance(lines, str) else "entries")


def taps_without_duplicates(taps: Iterable[TapSpec], units: str = "entries") -> tuple[TapSpec, ...]:
    seen: dict[str, TapSpec] = {}
    for tap in taps:
        key = " ".join(tap.text.split())
        if key in seen:
            raise PlanError(f"the same tap twice ({units} {seen[key].line} and {tap.line}): {tap.text}")
        seen[key] = tap
    return tuple(seen.values())
