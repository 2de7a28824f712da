"""The documentation site (mkdocs.yml: mkdocs-material, the API reference built from docstrings by
mkdocstrings) builds with `mkdocs build --strict`, and a broken link, a missing API object or a
cross-reference to nothing fails that build."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from places import ROOT

PUBLIC_API = {   # page of the site -> what it must document
    "api/engine": ["tapc.api.llm.VLLM", "tapc.api.llm.VLLM.generate", "tapc.api.async_llm.AsyncVLLM",
                   "tapc.api.requests.TapRequest"],
    "api/plan": ["tapc.plan.planner.build_plan"],
    "api/data": ["tapc.data.Shards", "tapc.data.Activations"],
    "api/client": ["tapc.serving.client.TapcClient"],
    "api/errors": ["tapc.errors.TapcError", "tapc.errors.RequestError"],
}


def build(project: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=project, env=env, capture_output=True, text=True, timeout=600)


def test_the_site_builds_strictly_with_the_public_api(tmp_path):
    done = build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for page, names in PUBLIC_API.items():
        html = (tmp_path / "site" / page / "index.html").read_text()
        missing = [name for name in names if f'id="{name}"' not in html]
        assert not missing, f"{page}: {missing} not documented"
    assert (tmp_path / "site" / "results" / "gpu-suite" / "index.html").exists(), "benchmarks/results/ on the site"


@pytest.mark.parametrize("page, text, says", [
    ("index.md", "\n[a page](no-such-page.md)\n", "no-such-page.md"),
    ("api/errors.md", "\n::: tapc.errors.NoSuchError\n", "tapc.errors.NoSuchError"),
    ("index.md", "\n[an object][tapc.errors.NoSuchError]\n", "tapc.errors.NoSuchError"),
], ids=["broken link", "missing API object", "broken cross-reference"])
def test_a_broken_link_or_reference_fails_the_build(tmp_path, page, text, says):
    project = tmp_path / "project"
    shutil.copytree(ROOT / "docs", project / "docs")
    shutil.copytree(ROOT / "benchmarks" / "results", project / "benchmarks" / "results")
    for name in ("mkdocs.yml", "mkdocs_hooks.py"):
        shutil.copy(ROOT / name, project / name)
    (project / "tapc").symlink_to(ROOT / "tapc")
    with open(project / "docs" / page, "a") as f:
        f.write(text)
    done = build(project, tmp_path / "site")
    assert done.returncode != 0, f"a strict build passed with {text!r} in {page}"
    assert says in done.stdout + done.stderr
