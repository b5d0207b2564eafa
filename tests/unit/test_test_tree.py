"""The tests' own layout (docs/architecture.md, "The tests"): three tiers of test modules,
what they share in tests/support/, and no test module importing another. A newcomer finds
a model, a reference run or a launcher in support/, never in another test file."""

import ast
import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIERS = ("unit", "multiprocess", "integration")
# what starts processes: the unit tier (single-process, pure) uses none of it
PROCESSES = (
    "support.launch",
    "support.pool",
    "support.forked",
    "subprocess",
    "multiprocessing",
    "torch.multiprocessing",
)


def _python_files():
    for dirpath, dirnames, files in os.walk(TESTS):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in sorted(files):
            if f.endswith(".py"):
                yield os.path.relpath(os.path.join(dirpath, f), TESTS)


def _imports(source: str) -> list:
    """Every module a source imports (function-level imports too), as written."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
    return out


def _cross_imports(sources: dict) -> list:
    """'file imports module' for each import of a test module or of conftest."""
    return [
        f"{path} imports {m}"
        for path, src in sorted(sources.items())
        for m in _imports(src)
        if m.split(".")[-1].startswith("test_") or m == "conftest"
    ]


def _read(rel):
    with open(os.path.join(TESTS, rel), encoding="utf-8") as f:
        return f.read()


def test_no_test_module_imports_another():
    sources = {p: _read(p) for p in _python_files()}
    assert len(sources) > 60
    bad = _cross_imports(sources)
    assert not bad, "move what is shared into tests/support/:\n" + "\n".join(bad)


def test_the_import_rule_finds_planted_violations():
    planted = {
        "unit/test_a.py": "from test_b import Net\n",
        "unit/test_c.py": "def f():\n    import test_d\n",
        "multiprocess/test_e.py": "from conftest import get_pool\nfrom support.models import Residual\n",
        "support/x.py": "from multiprocess.test_f import g\n",
    }
    assert _cross_imports(planted) == [
        "multiprocess/test_e.py imports conftest",
        "support/x.py imports multiprocess.test_f",
        "unit/test_a.py imports test_b",
        "unit/test_c.py imports test_d",
    ]


def test_shared_code_lives_in_support_and_tests_in_their_tier():
    """Outside tests/support/ there are only test modules (in a tier's folder) and conftest.py;
    support/ holds no test module."""
    misplaced = []
    for rel in _python_files():
        parts = rel.split(os.sep)
        if parts[0] == "support":
            if parts[-1].startswith("test_"):
                misplaced.append(f"{rel}: a test module among the shared code")
        elif rel != "conftest.py" and not (len(parts) == 2 and parts[0] in TIERS and parts[1].startswith("test_")):
            misplaced.append(f"{rel}: shared code goes in tests/support/, tests in {', '.join(TIERS)}")
    assert not misplaced, "\n".join(misplaced)
    assert os.path.isfile(os.path.join(TESTS, "support", "__init__.py"))


def test_unit_tests_start_no_processes():
    """The unit tier is pure and single-process: it imports no launcher and takes no pool."""
    bad = []
    for name in sorted(os.listdir(os.path.join(TESTS, "unit"))):
        if not name.endswith(".py"):
            continue
        source = _read(os.path.join("unit", name))
        tree = ast.parse(source)
        bad += [f"unit/{name} imports {m}" for m in _imports(source) if m in PROCESSES]
        bad += [
            f"unit/{name}: {f.name} takes dist_pool"
            for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef) and "dist_pool" in [a.arg for a in f.args.args]
        ]
    assert not bad, "these belong in tests/multiprocess/ or tests/integration/:\n" + "\n".join(bad)
