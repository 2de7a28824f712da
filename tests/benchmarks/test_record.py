"""benchmarks/results/rows.csv is the benchmarks' data: every row fits the schema, summary.md is
what `python3 benchmarks/record.py tables` makes of it (nobody edits it by hand), and every
ratio the README's Speed table quotes is a row of its script."""
import datetime
import re
import sys
from decimal import ROUND_HALF_UP, Decimal

import pytest
from places import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import record  # noqa: E402

ROWS = record.load()


def test_the_summary_is_generated_from_the_rows():
    assert record.SUMMARY.read_text() == record.tables(ROWS), "run `python3 benchmarks/record.py tables`"


def test_the_header_is_the_schema():
    assert record.ROWS.read_text().splitlines()[0] == ",".join(record.FIELDS)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r['script']}:{r['date']}:{r['workload']}:{r['variant']}")
def test_a_row_fits_the_schema(row):
    assert row["script"] and row["variant"] and row["workload"] and row["metric"], row
    datetime.date.fromisoformat(row["date"])
    ratio = float(row["ratio"])
    assert ratio > 0, row
    assert bool(row["low"]) == bool(row["high"]), "a range has both ends"
    if row["low"]:
        assert float(row["low"]) <= ratio <= float(row["high"]), row


def speed_table() -> list[tuple[str, list[str]]]:
    """The README's Speed table: (script, the ratios its first cell quotes)."""
    section = ROOT.joinpath("README.md").read_text().split("## Speed", 1)[1].split("\n## ", 1)[0]
    quoted = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        link = re.match(r"\[(bench_\w+)\]", cells[-1]) if len(cells) == 3 else None
        if link:
            quoted.append((f"{link.group(1)}.py", re.findall(r"\d+\.\d+", cells[0])))
    return quoted


def test_the_readme_speed_table_is_read():
    assert len(speed_table()) >= 10


@pytest.mark.parametrize("script,quoted", speed_table(), ids=lambda x: x if isinstance(x, str) else None)
def test_every_ratio_the_readme_quotes_is_a_row(script, quoted):
    mine = [Decimal(r["ratio"]) for r in ROWS if r["script"] == script]
    for text in quoted:   # the README rounds half up to the places it quotes
        places = Decimal(1).scaleb(-len(text.split(".")[1]))
        assert any(r.quantize(places, ROUND_HALF_UP) == Decimal(text) for r in mine), f"{script}: {text}"
