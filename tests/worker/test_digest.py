"""The compile-cache digest covers every tapc file whose code reaches the compiled graphs."""
import sys
from pathlib import Path

import torch
from engine_toy import toy_buffers, ToyModel, toy_plan
from places import ROOT

from tapc.api.engine_args import digest, graph_code
from tapc.worker.install import install
from tapc.worker.layout import Layout

# Every kind of in-graph tap and every edit op, at every kind of site (Python blocks run their
# runtime eagerly between graph pieces: that code is not in the graphs).
TAPS = ["model.layers.*.resid", "model.layers.0.mlp.input", "model.layers.1.mlp.down_proj.output",
        "model.layers.2.mlp.source.h_split_0.output[1]", "model.layers.1.mlp.source.self_down_proj_0.input",
        "model.layers.0.resid | add(steer, alpha=a)", "model.layers.1.resid | scale(0.5)",
        "model.layers.2.resid | set([1, 2], value=3.0)", "model.layers.0.mlp.up_proj.output | zero(cols)",
        "model.layers.2.mlp.down_proj.output | project_out(d)", "model.layers.1.resid | lens(k=3)"]



def tapc_files_run(fn) -> set[Path]:
    """The files of this checkout (tapc/, tapc/kernels/) whose Python functions run in fn()."""
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            seen.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    files = {Path(f).resolve() for f in seen if not f.startswith("<")}
    return {f for f in files if f.is_relative_to(ROOT / "tapc") or f.is_relative_to(ROOT / "kernels")}


def test_every_file_that_reaches_the_graphs_is_in_the_digest():
    plan = toy_plan(TAPS)
    layout = Layout(plan)
    buffers = toy_buffers(layout, 64, 8)
    model = ToyModel()
    ids, pos = torch.tensor([3, 1, 4, 1, 5]), torch.arange(5)

    def install_and_run():
        install(model, layout, buffers)
        buffers.table.fill_(0)     # every row owned, so every op does its work
        model(ids, pos)

    ran = tapc_files_run(install_and_run)
    covered = {p.resolve() for p in graph_code()}
    assert ran, "nothing traced"
    assert ROOT / "tapc/worker/source.py" in ran and ROOT / "tapc/kernels/edit.py" in ran
    missing = sorted(str(p.relative_to(ROOT)) for p in ran - covered)
    assert not missing, f"code that reaches the graphs but not the compile-cache digest: {missing}"


def test_the_digest_changes_with_any_covered_file(monkeypatch):
    plan = toy_plan(TAPS[:1])
    base = digest(plan)
    for path in graph_code():
        real = Path.read_bytes

        def read_bytes(p, _path=path, _real=real):
            data = _real(p)
            return data + b"#" if p == _path else data

        monkeypatch.setattr(Path, "read_bytes", read_bytes)
        assert digest(plan) != base, f"{path} is listed but does not change the digest"
        monkeypatch.setattr(Path, "read_bytes", real)
