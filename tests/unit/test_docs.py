"""The documentation's files agree with each other (pure file checks; no mkdocs import).

README.md stays a short front page; every page in mkdocs.yml's nav exists and every
docs page is in the nav; every snippet a page includes (``--8<-- "path"``) exists;
the API reference names every public name of zeroshard.
"""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")
README_MAX_LINES = 250


def _read(*parts):
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def _nav_pages():
    """The .md paths in mkdocs.yml's nav (entries like ``- Title: page.md`` or ``- page.md``)."""
    text = _read("mkdocs.yml")
    m = re.search(r"^nav:\n((?:[ \t]+.*\n|\n)+)", text, re.M)
    assert m, "mkdocs.yml has no nav"
    return re.findall(r"""^\s*-\s*(?:(?:"[^"\n]*"|'[^'\n]*'|[^:"'\n]+):\s*)?([\w./-]+\.md)\s*$""", m.group(1), re.M)


def _doc_pages():
    pages = []
    for dirpath, dirnames, filenames in os.walk(DOCS):
        dirnames[:] = [d for d in dirnames if not d.startswith("_")]
        for name in filenames:
            if name.endswith(".md"):
                pages.append(os.path.relpath(os.path.join(dirpath, name), DOCS).replace(os.sep, "/"))
    return sorted(pages)


def test_readme_is_a_short_front_page():
    lines = _read("README.md").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    # measurements live on the Benchmarks page: the front page's one table is the memory table
    rows = [k for k, line in enumerate(lines) if line.startswith("|")]
    assert rows and rows == list(range(rows[0], rows[0] + len(rows))), "README.md has a second table"
    assert "bf16 parameters, fp32 master" in lines[rows[0]] and not any("bench:" in line for line in lines)


def test_every_nav_page_exists():
    nav = _nav_pages()
    assert "index.md" in nav and "api.md" in nav
    missing = [p for p in nav if not os.path.isfile(os.path.join(DOCS, p))]
    assert not missing, f"in mkdocs.yml's nav but not in docs/: {missing}"


def test_every_docs_page_is_in_the_nav():
    nav = set(_nav_pages())
    orphans = [p for p in _doc_pages() if p not in nav]
    assert not orphans, f"docs pages missing from mkdocs.yml's nav: {orphans}"


def test_every_snippet_include_exists():
    pattern = re.compile(r"""--8<--\s+["']([^"']+)["']""")
    includes = []
    for page in _doc_pages():
        for path in pattern.findall(_read("docs", page)):
            includes.append((page, path))
    assert includes, "no page includes an example"
    missing = [(page, path) for page, path in includes if not os.path.isfile(os.path.join(ROOT, path))]
    assert not missing, f"snippets that name no file (page, path): {missing}"


def test_api_reference_covers_the_public_api():
    tree = ast.parse(_read("python", "zeroshard", "__init__.py"))
    public = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
    )
    api = _read("docs", "api.md")  # a mkdocstrings block, or a heading for a compiled class
    documented = set(re.findall(r"^::: zeroshard\.(\w+)\s*$", api, re.M))
    documented |= set(re.findall(r"^#+ `zeroshard\.(\w+)`", api, re.M))
    assert not set(public) - documented, f"public names missing from docs/api.md: {sorted(set(public) - documented)}"


def test_the_memory_table_is_the_planners():
    """The memory tables (README, home page, choosing a stage): each stage's 7B-on-8-GPUs figures are what the
    planner's formula gives for bf16 parameters with an fp32 master and for fp32 parameters."""
    from zeroshard.plan.formula import model_state_bytes

    want = {dt: {s: r["total"] / 1e9 for s, r in model_state_bytes(7e9, 8, dt).items()} for dt in ("bf16", "fp32")}
    for page in ("README.md", os.path.join("docs", "index.md"), os.path.join("docs", "choosing-a-stage.md")):
        rows = [line.split("|")[1:-1] for line in _read(page).splitlines() if re.match(r"\| (DDP|ZeRO-[123]) \|", line)]
        assert [r[0].strip() for r in rows] == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"], page
        for r in rows:
            stage = r[0].strip()
            got = [float(c.strip().removesuffix(" GB")) for c in r if c.strip().endswith(" GB")]
            assert got == [want["bf16"][stage], want["fp32"][stage]], (page, stage, got)


def test_every_docs_pointer_in_the_code_resolves():
    """A message or docstring that sends the reader to ``docs/<page>.md`` (and a section,
    ``("Title")`` or ``('Title')`` after it) names a page and heading that exist."""
    bad = []
    for dirpath, _, filenames in os.walk(os.path.join(ROOT, "python", "zeroshard")):
        for name in filenames:
            if not name.endswith(".py"):
                continue
            text = open(os.path.join(dirpath, name), encoding="utf-8").read()
            for page, title in re.findall(r"""docs/([\w/-]+\.md)(?:,? \(?["']([^"']+)["'])?""", text):
                path = os.path.join(DOCS, page)
                if not os.path.isfile(path):
                    bad.append((name, page))
                elif title and not re.search(rf"^#+ {re.escape(title)}\s*$", _read("docs", page), re.M):
                    bad.append((name, page, title))
    assert not bad, bad


def test_the_product_speaks_of_itself_alone():
    """No page, the README nor the results name internal issue numbers or how the project's
    machines were used (torch.profiler's own "session" aside)."""
    pages = ["README.md", os.path.join("benchmarks", "RESULTS.md")] + [os.path.join("docs", p) for p in _doc_pages()]
    hits = [
        (p, line)
        for p in pages
        for line in _read(p).splitlines()
        if re.search(r"issue [0-9]+|session|device time", line, re.I)
        and "profiler" not in line
        and not line.startswith("start is still running as the session ends")
    ]
    assert not hits, hits
