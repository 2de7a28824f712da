"""The tap DSL: what parses to what, and the message each malformed tap gets."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tapc.errors import PlanError, TapcError, TapSyntaxError
from tapc.lang.syntax import Action, Param, Pick, Slice, Star, parse_tap, parse_taps

GOOD = [
    ("model.layers.*.output[0]", dict(path=("model", "layers", Star()), site="output", element=0)),
    ("model.layers[0:32:4].resid", dict(path=("model", "layers", Slice(0, 32, 4)), site="resid")),
    ("model.layers[::2].resid", dict(path=("model", "layers", Slice(None, None, 2)), site="resid")),
    ("model.layers[1,5,9].mlp.input", dict(path=("model", "layers", Pick((1, 5, 9)), "mlp"), site="input")),
    ("model.layers.10.self_attn.source.qkv_split_0.output[2]",
     dict(path=("model", "layers", "10", "self_attn"), site="source", op="qkv_split_0", io="output", element=2)),
    ("model.layers.0.self_attn.source.self_o_proj_0.input",
     dict(site="source", op="self_o_proj_0", io="input", element=None)),
    ("logits", dict(path=(), site="logits")),
    ("samples  # the sampled ids", dict(site="samples", text="samples")),
    ("logits_processor.output", dict(path=("logits_processor",), site="output")),
    ("model.layers.3.resid | capture", dict(action=Action())),
    ("model.layers.3.resid | add(steer, alpha=4.0)",
     dict(action=Action("add", (("vector", Param("steer")), ("alpha", 4.0), ("at", "all"))))),
    ("model.layers.3.resid | add(steer, alpha=k, at=generated)",
     dict(action=Action("add", (("vector", Param("steer")), ("alpha", Param("k")), ("at", "generated"))))),
    ("model.layers.3.mlp.act_fn.output | set([1, 7], value=[0.5, -2])",
     dict(action=Action("set", (("cols", (1, 7)), ("value", (0.5, -2)), ("at", "all"))))),
    ("model.layers.3.mlp.act_fn.output | zero(12, at=last)",
     dict(action=Action("zero", (("cols", (12,)), ("at", "last"))))),
    ("model.layers.3.resid | scale(0.5)", dict(action=Action("scale", (("factor", 0.5), ("at", "all"))))),
    ("model.layers.3.resid | project_out(refusal)",
     dict(action=Action("project_out", (("direction", Param("refusal")), ("at", "all"))))),
    ("model.layers.5.mlp.output -> probe", dict(action=Action("block", block="probe"))),
]


@pytest.mark.parametrize("text,fields", GOOD, ids=[g[0] for g in GOOD])
def test_parses(text, fields):
    tap = parse_tap(text)
    for name, value in fields.items():
        assert getattr(tap, name) == value, name


# Malformed taps and the words their message must carry (lark-style table of examples).
BAD = [
    ("model.layers.*.", "the tap ends too early: expected", "column 16"),
    ("model.layers..output", "unexpected '.'", "column 14"),
    ("model.layers.3 output", "unexpected 'output': expected `.`", "column 16"),
    ("model.layers[1:2.output", "expected `:` or `]`", "column 17"),
    ("model.layers.3.resid $", "unexpected character '$'", "column 22"),
    ("model.layers.3.resid ->", "expected a name", "->"),
    ("", "empty tap", "column 1"),
    ("model.layers.3.resid | add()", "add() needs its argument 'vector'", "add(vector)"),
    ("model.layers.3.resid | steer(x)", "unknown action 'steer'", "capture, add, scale, set, zero, project_out"),
    ("model.layers.3.resid | add(v, beta=2)", "add() has no argument 'beta'", "vector, alpha, at"),
    ("model.layers.3.resid | add(v, 1, 2)", "add() takes 2 positional", "vector"),
    ("model.layers.3.resid | add(v, alpha=1, alpha=2)", "given twice", "'alpha'"),
    ("model.layers.3.resid | add(alpha=1, v)", "positional argument follows a named one", "add()"),
    ("model.layers.3.resid | zero(cols=[1,-2])", "must be column indices", "'cols'"),
    ("model.layers.3.resid | zero([1, 1])", "names a column twice", "'cols'"),
    ("model.layers.3.resid | add(steer, at=foo)", "'at' must be one of all, prompt, generated, last", "add()"),
    ("model.layers.3.resid | scale([1, 2])", "'factor' must be a number or a parameter name", "scale()"),
    ("model.layers.3.resid | add(3)", "'vector' must be a parameter name", "list of numbers"),
    ("model.layers.3.resid | capture(1)", "capture takes no arguments", "capture"),
    ("logits->model.", "unexpected '.': expected the end of the tap", "column 14"),  # found by the fuzz run
    # a near miss of the point word gets the word; a point without one is told the words
    ("model.layers.*.outptu", "did you mean `model.layers.*.output`?", "column 22"),
    ("model.layers.0.inptu", "did you mean `model.layers.0.input`?", "ends too early"),
    ("model.layers.3.mlp", "a module point ends in `.output`, `.input`, `.resid` or `.source.<op>.output`", "column 19"),
    ("model.layers.3.resid | ad(x)", "unknown action 'ad': did you mean `add`?", "column 23"),
    # limits (docs/dsl.md): size, path parts, bracket depth, digits; numbers are finite
    ("model." + "a." * 600 + "output", "a point of 602 parts; a point has at most 64", "column 1"),
    ("x.output | add(" + "[" * 600 + "1" + "]" * 600 + ")", "brackets nested more than 8 deep", "column 24"),
    ("x.output[" + "9" * 5000 + "]", "a tap of 5010 characters; taps are at most 2000", "x.output[999"),
    ("x.output[" + "9" * 40 + "]", "a number of 40 digits; numbers have at most 18", "column 10"),
    ("x.output | set(1, value=-" + "9" * 30 + ".5)", "a number of 30 digits", "column 25"),
    ("x.output | scale(1e999)", "'1e999' is not a finite number", "column 18"),
    ("x.output | scale(-1e400)", "'-1e400' is not a finite number", "column 18"),
    ("a" * 900_000, "a tap of 900000 characters", "starts 'aaaa"),
]


@pytest.mark.parametrize("text,words", [(b[0], b[1:]) for b in BAD], ids=[b[0][:48] or "<empty>" for b in BAD])
def test_rejects_with_message(text, words):
    with pytest.raises(TapSyntaxError) as info:
        parse_tap(text)
    message = str(info.value)
    for w in words:
        assert w in message, message
    assert text.strip().startswith(info.value.tap.strip()) or not text
    assert len(message) < 600, "a message quotes a bounded part of the tap"


def test_caret_points_at_the_column():
    with pytest.raises(TapSyntaxError) as info:
        parse_tap("model.layers.3.resid | add(x) junk")
    _, shown, caret = str(info.value).splitlines()
    assert shown.strip() == "model.layers.3.resid | add(x) junk"
    assert shown[caret.index("^")] == "j"
    assert info.value.column == len("model.layers.3.resid | add(x) ") + 1


def test_many_taps_comments_blank_lines_and_duplicates():
    taps = parse_taps("""
        # residual stream everywhere
        model.layers.*.resid

        model.layers.3.resid | add(steer)   # steer one layer
    """)
    assert [t.site for t in taps] == ["resid", "resid"]
    assert [t.line for t in taps] == [3, 5]
    with pytest.raises(PlanError, match=r"the same tap twice \(entries 1 and 2\)"):
        parse_taps(["model.layers.3.resid", "model.layers.3.resid   # again"])
    with pytest.raises(TapSyntaxError, match="tap 1 is a int"):
        parse_taps([3])


def test_errors_share_one_root():
    with pytest.raises(TapcError):
        parse_tap("model..x")
    assert issubclass(TapSyntaxError, ValueError)


WORDS = ["model", "layers", ".", "*", "[", "]", "0", "17", "-3", ":", ",", "|", "(", ")", "->", "=", "#", "_", " ",
         "resid", "output", "input", "source", "logits", "samples", "add", "scale", "set", "x", "1e999", "4.5",
         "9" * 30, "[" * 12, "." * 70]


# The parser's fuzz run (bounded: a few seconds): every input is parsed or refused with tapc's own
# error in the tap's words (never Lark's terminal names, never a traceback).
@settings(max_examples=600, deadline=500)
@given(st.lists(st.sampled_from(WORDS), max_size=40).map("".join) | st.text(max_size=60))
def test_parser_fails_only_with_its_own_error(text):
    try:
        parse_tap(text)
    except TapSyntaxError as e:
        what = str(e).splitlines()[0]  # the lines after it echo the tap
        for raw in ("<END-OF-FILE>", "$END", "__ANON", "SIGNED_NUMBER", "LSQB", "Token("):
            assert raw not in what or raw in text, str(e)
    except PlanError:
        pass
