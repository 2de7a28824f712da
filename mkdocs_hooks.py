"""mkdocs hooks (mkdocs.yml `hooks:`): the measurements in benchmarks/results/ become pages of
the site under results/ (their data file beside them), and the cookbook's READMEs
(examples/*/README.md) pages under examples/, so that the docs' links to them, written as they
resolve in the repository (`../benchmarks/results/NAME.md`, `../examples/NAME/README.md`),
resolve on the site too and `--strict` checks them."""
from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).parent
BENCHMARKS = ROOT / "benchmarks"


def on_files(files, config):
    # the pages, and the data they are made from (rows.csv), which they link
    for path in sorted([*(BENCHMARKS / "results").glob("*.md"), *(BENCHMARKS / "results").glob("*.csv")]):
        files.append(File(f"results/{path.name}", str(BENCHMARKS), config["site_dir"], config["use_directory_urls"]))
    for path in sorted(ROOT.glob("examples/*/README.md")):
        page = path.relative_to(ROOT).as_posix()
        files.append(File(page, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri.startswith("results/"):
        # a results file's links to the docs (../../docs/NAME.md) point one level up on the site
        return markdown.replace("../../docs/", "../")
    if page.file.src_uri.startswith("examples/"):
        # an example's links to the docs (../../docs/NAME.md): the docs are the site's root
        return markdown.replace("../../docs/", "../../")
    # docs/x.md links ../benchmarks/results/..., docs/internals/x.md ../../benchmarks/results/...:
    # on the site both are one level up from where they point in the repository; the same for
    # docs/x.md's links to ../examples/...
    return markdown.replace("../benchmarks/results/", "results/").replace("../examples/", "examples/")
