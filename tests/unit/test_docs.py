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
    assert lines.count("<!-- bench:plots:start -->") == lines.count("<!-- bench:plots:end -->") == 1


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
    public = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets))
    api = _read("docs", "api.md")   # a mkdocstrings block, or a heading for a compiled class
    documented = set(re.findall(r"^::: zeroshard\.(\w+)\s*$", api, re.M))
    documented |= set(re.findall(r"^#+ `zeroshard\.(\w+)`", api, re.M))
    assert not set(public) - documented, f"public names missing from docs/api.md: {sorted(set(public) - documented)}"
