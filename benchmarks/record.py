"""The benchmarks' ratios to vanilla vLLM as data: one row a measured comparison in
results/rows.csv, and the summary tables made from them.

    python3 benchmarks/record.py tables    # results/summary.md from results/rows.csv

A bench calls `append` (or `append_compared`) when it has finished a comparison; the row gets
the date, tree, GPU and vLLM version of the run and its command line. The Markdown results
files keep the narrative; summary.md is generated, never edited by hand.
"""
import collections
import csv
import datetime
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROWS = RESULTS / "rows.csv"
SUMMARY = RESULTS / "summary.md"
# ratio: tapc's value over vanilla's in the same run (for a time, above 1 is slower); low and
# high: the lowest and highest of the rounds' own ratios, empty where the source gives none;
# source: the results file a backfilled row was read from, or the bench's --out file
FIELDS = ("script", "variant", "workload", "gpu", "tree", "date", "vllm", "ratio", "low", "high", "metric",
          "command", "source")


def context() -> dict:
    """What a row measured on: today, the tree, the GPUs, vLLM's version, the command line."""
    tree = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=RESULTS).stdout.strip()
    row = {"date": datetime.date.today().isoformat(), "tree": tree,
           "command": shlex.join(["python3", *sys.argv])}
    try:   # benches import both; a CPU-only caller records no GPU
        import torch
        import vllm
    except ImportError:
        return row
    row["vllm"] = vllm.__version__
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        row["gpu"] = f"{count} x {torch.cuda.get_device_name()}" if count > 1 else torch.cuda.get_device_name()
    return row


def append(row: dict, path: Path = ROWS) -> None:
    """One comparison, its measuring context filled where `row` leaves it out."""
    full = {**context(), **row}
    unknown = set(full) - set(FIELDS)
    assert not unknown, f"not in the schema: {sorted(unknown)}"
    new = not path.exists() or path.stat().st_size == 0
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, FIELDS, lineterminator="\n")
        if new:
            writer.writeheader()
        writer.writerow(full)


def compared(results: dict, workloads) -> list[dict]:
    """results: (workload, variant) -> values, one a round in round order, "vanilla" the
    baseline. Each variant's median, its ratio to vanilla's median, and the median, lowest and
    highest of each round's own ratio (a run shares the machine's state with the vanilla run of
    its round, so a drift over the rounds cancels); ratio and per-round figures are None where
    this run has no vanilla to compare with."""
    out = []
    for w in workloads:
        vanilla = results.get((w, "vanilla"))
        base = statistics.median(vanilla) if vanilla else None
        for (wl, name), values in results.items():
            if wl != w:
                continue
            v = statistics.median(values)
            per = [a / b for a, b in zip(values, vanilla)] \
                if name != "vanilla" and vanilla and len(vanilla) == len(values) else []
            out.append({"workload": w, "variant": name, "value": v, "ratio": v / base if base else None,
                        "per_round": statistics.median(per) if per else None,
                        "low": min(per) if per else None, "high": max(per) if per else None})
    return out


def append_compared(script: str, results: dict, workloads, metric, source: str | None = None) -> None:
    """A row for each tapped variant of `compared(results, workloads)`; metric: the unit, or a
    function of the workload that gives it."""
    for c in compared(results, workloads):
        if c["variant"] == "vanilla" or c["ratio"] is None:
            continue
        append({"script": script, "variant": c["variant"], "workload": c["workload"], "ratio": f"{c['ratio']:.3f}",
                "low": "" if c["low"] is None else f"{c['low']:.3f}",
                "high": "" if c["high"] is None else f"{c['high']:.3f}",
                "metric": metric(c["workload"]) if callable(metric) else metric, "source": source or ""})


def load(path: Path = ROWS) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def tables(rows: list[dict]) -> str:
    """Per script, the latest ratio of each workload, variant and GPU (rows are in the order
    measured, so the last of a date is the latest), with its rounds' range and how many rows
    measured it."""
    latest: dict[tuple, dict] = {}
    counts: collections.Counter = collections.Counter()
    for row in rows:
        key = (row["script"], row["workload"], row["variant"], row["gpu"])
        counts[key] += 1
        if key not in latest or row["date"] >= latest[key]["date"]:
            latest[key] = row
    lines = ["# Summary of the measured ratios", "",
             "Generated from [rows.csv](rows.csv) by `python3 benchmarks/record.py tables`; do not edit by hand. "
             "Each line is the latest measurement of a workload and variant on a GPU: tapc's value over vanilla "
             "vLLM's in the same run (for a time in seconds, above 1 is slower), the lowest and highest of its "
             "rounds' own ratios where recorded, and how many rows of rows.csv measured it.", ""]
    for script in sorted({k[0] for k in latest}):
        lines += [f"## {script}", "", "| workload | variant | GPU | ratio | rounds | metric | date | tree | rows |",
                  "|---|---|---|---:|---:|---|---|---|---:|"]
        for key in sorted(k for k in latest if k[0] == script):
            row = latest[key]
            spread = f"{row['low']}-{row['high']}" if row["low"] else ""
            lines.append(f"| {row['workload']} | {row['variant']} | {row['gpu']} | {row['ratio']}x | {spread} | "
                         f"{row['metric']} | {row['date']} | {row['tree']} | {counts[key]} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:] != ["tables"]:
        sys.exit(__doc__)
    SUMMARY.write_text(tables(load()))
    print(f"wrote {SUMMARY}")


if __name__ == "__main__":
    main()
