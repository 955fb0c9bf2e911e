"""The figures in the documentation are the published runs' own: each one cites the results
file it comes from, and says there what it is.

Convention (benchmarks/results/README.md): a measured figure is written as a link whose text
is the figure as shown and whose target is a results file with the JSON path of the value as
its fragment, e.g. `[0.708](benchmarks/results/full-2026-12-02.json#strategies.mlp.parity.ratio)`
(dotted keys, list indices as integers; `*100` after the path for a percentage). Checked here:
- every such link in README.md, docs/*.md and benchmarks/README.md names a file that is there
  and a path that is in it, and its text equals the value rounded to the decimals shown
  (`yes` / `no` for a boolean);
- README.md shows no figure outside such a link: no number with a unit of time, percent or
  ratio (`12.5 s`, `29 %`, `1.3x`) and no bare three-decimal ratio in its prose (code blocks,
  inline code and comments aside: they show output and commands, not claims).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
CITATION = re.compile(r"\[([^\]\n]+)\]\(((?:[\w.-]+/)*results/[\w.-]+\.json)#([\w.\-]+?)(\*100)?\)")
NUMBER = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})*(?:\.\d+)?$|^[-+]?\d+(?:\.\d+)?$")
# a figure in prose: a number with a unit of time, percent or ratio, or a bare 3-decimal ratio
UNCITED = re.compile(r"(?<![\w.\-/])(\d[\d,]*(?:\.\d+)?\s?(?:s|ms|min|%|x|×)(?![\w/])|\d\.\d{3}(?!\d))")
FENCED = re.compile(r"^```.*?^```", re.S | re.M)
COMMENT = re.compile(r"<!--.*?-->", re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
NOT_FIGURES = re.compile(r"95 % interval")  # a confidence level, not a measurement


def lookup(data: Any, path: str) -> Any:
    for part in path.split("."):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


def problems(page: Path) -> list[str]:
    """What is wrong with the citations of one page: a missing file or path, a figure that differs."""
    out = []
    # a citation inside a comment waits for its run (a sentence for the next rerun to fill)
    text = COMMENT.sub(lambda m: " " * len(m.group(0)), page.read_text())
    for match in CITATION.finditer(text):
        shown, target, path, percent = match.groups()
        line = text.count("\n", 0, match.start()) + 1
        where = f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}:{line}"
        file = (page.parent / target).resolve()
        if not file.is_file():
            out.append(f"{where}: cites {target}, which is not there")
            continue
        try:
            value = lookup(json.loads(file.read_text()), path)
        except (KeyError, IndexError, ValueError, TypeError):
            out.append(f"{where}: {target} has no {path}")
            continue
        if isinstance(value, bool) or shown in ("yes", "no"):
            if value is not (shown == "yes"):
                out.append(f"{where}: shows {shown!r}, {target}#{path} is {value!r}")
            continue
        if not NUMBER.match(shown) or not isinstance(value, (int, float)):
            out.append(f"{where}: {shown!r} is not a number as written, or {target}#{path} ({value!r}) is not one")
            continue
        decimals = len(shown.split(".")[1]) if "." in shown else 0
        expected = round(float(value) * (100 if percent else 1), decimals)
        if abs(float(shown.replace(",", "")) - expected) > 10 ** -(decimals + 3):
            out.append(f"{where}: shows {shown}, {target}#{path}{percent or ''} rounds to {expected:.{decimals}f}")
    return out


def uncited(page: Path) -> list[str]:
    """Figures in a page's prose that cite nothing."""
    text = page.read_text()
    for pattern in (FENCED, COMMENT, CITATION, INLINE_CODE, NOT_FIGURES):
        text = pattern.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return [f"{page.name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in UNCITED.finditer(text)]


def test_every_cited_figure_is_its_results_file_value():
    found = [p for page in PAGES for p in problems(page)]
    assert not found, "\n".join(found)
    assert CITATION.search((ROOT / "README.md").read_text()), "README.md cites no results file"


def test_the_readme_shows_no_figure_without_its_results_file():
    found = uncited(ROOT / "README.md")
    assert not found, "figures in README.md without a results file (write them as [figure](results-file#path)):\n" + \
        "\n".join(found)


def test_the_check_fails_on_a_changed_figure_or_a_missing_file(tmp_path):
    """The checks above can fail: a figure one digit off, a file not there, a path not in it, a bare figure."""
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "x-2026-01-01.json").write_text(json.dumps({"a": {"b": [0.70799, True]}, "w": 0.0045}))
    page = tmp_path / "README.md"
    good = ("[0.708](benchmarks/results/x-2026-01-01.json#a.b.0) [yes](benchmarks/results/x-2026-01-01.json#a.b.1) "
            "[0.4](benchmarks/results/x-2026-01-01.json#w*100) %")
    page.write_text(good)
    assert problems(page) == [] and uncited(page) == []
    page.write_text(good.replace("[0.708]", "[0.709]"))
    assert "rounds to 0.708" in " ".join(problems(page))
    page.write_text(good.replace("x-2026-01-01.json#a.b.0", "y-2026-01-01.json#a.b.0"))
    assert "which is not there" in " ".join(problems(page))
    page.write_text(good.replace("#a.b.1", "#a.c"))
    assert "has no a.c" in " ".join(problems(page))
    page.write_text(good + " and a first step at 12.5 s, 29 % faster, 0.954 on the GPT")
    assert [u.split(": ", 1)[1] for u in uncited(page)] == ["'12.5 s'", "'29 %'", "'0.954'"]
