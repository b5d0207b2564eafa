"""Control runs one way: the model side (ZeRO-1/2 buckets, ZeRO-3 units) never names an
optimizer, and no module keeps a registry keyed by ``id()``.

The optimizer decides layouts and binds to them; the model side exposes what it holds and
answers through protocols (``core/claims.py``'s ``Claimant``, ``zero3/records.py``'s
``Stepper``, ``core/source.py``'s ``Rebind``). Per-object state lives in the package's own
objects (a ``ShardedParameter``'s ``owner_ref``), not in module-level maps from ``id()``.
"""

import ast
import os
import re

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PACKAGE = os.path.join(ROOT, "python", "zeroshard")
MODEL_SIDE = ("zero3", "zero12")
# an identifier that names an optimizer or one of its methods
# (FSDP2's method set_post_optim_event is the module API's contract, not a reference to ours)
OPTIMIZER_NAME = re.compile(r"^(?!set_post_optim_event$).*optim|^opt$|^params_wrapped$|^units_relaid$", re.IGNORECASE)
KEYED_CALLS = {"get", "pop", "setdefault", "add", "discard", "remove", "__contains__", "__getitem__"}


def _identifiers(tree: ast.AST):
    """(line, identifier) for every name the code uses or defines (not its comments or strings)."""
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.keyword) and node.arg:
            names = [node.arg]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for n in names:
            yield node.lineno, n


def optimizer_references(sources: dict) -> list:
    """``file:line: name`` for each identifier naming an optimizer, over ``sources`` ({rel: text})."""
    return [
        f"{rel}:{line}: {name}"
        for rel, src in sorted(sources.items())
        for line, name in _identifiers(ast.parse(src))
        if OPTIMIZER_NAME.search(name)
    ]


def _module_names(tree: ast.Module) -> set:
    out = set()
    for node in tree.body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AnnAssign, ast.AugAssign))
            else []
        )
        out.update(t.id for t in targets if isinstance(t, ast.Name))
    return out


def _is_id_call(node) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "id"


def id_keyed_registries(sources: dict) -> list:
    """``file:line: NAME`` where a module-level name is used as a map or set keyed by ``id()``
    (``NAME[id(x)]``, ``NAME.get(id(x))``, ``id(x) in NAME``, ...), or is a WeakIdKeyDictionary."""
    bad = []
    for rel, src in sorted(sources.items()):
        tree = ast.parse(src)
        glob = _module_names(tree)
        for node in tree.body:
            if (
                isinstance(node, (ast.Assign, ast.AnnAssign))
                and isinstance(node.value, ast.Call)
                and "WeakIdKeyDictionary" in ast.unparse(node.value.func)
            ):
                bad.append(f"{rel}:{node.lineno}: {ast.unparse(node.value)}")
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Subscript) and _is_id_call(node.slice) and isinstance(node.value, ast.Name):
                name = node.value.id
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in KEYED_CALLS
                and node.args
                and _is_id_call(node.args[0])
                and isinstance(node.func.value, ast.Name)
            ):
                name = node.func.value.id
            elif (
                isinstance(node, ast.Compare)
                and _is_id_call(node.left)
                and isinstance(node.ops[0], (ast.In, ast.NotIn))
                and isinstance(node.comparators[0], ast.Name)
            ):
                name = node.comparators[0].id
            if name in glob:
                bad.append(f"{rel}:{node.lineno}: {name}")
    return bad


def _package_sources(folders=None) -> dict:
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        rel_folder = os.path.relpath(folder, PACKAGE)
        if folders is not None and rel_folder.split(os.sep)[0] not in folders:
            continue
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(folder, f)) as fh:
                    out[os.path.normpath(os.path.join(rel_folder, f))] = fh.read()
    return out


def test_the_model_side_never_names_an_optimizer():
    sources = _package_sources(MODEL_SIDE)
    assert len(sources) > 15, sorted(sources)  # it sees zero3/ and zero12/
    bad = optimizer_references(sources)
    assert not bad, (
        "zero3/ and zero12/ name an optimizer (expose what the model holds and answer through "
        "a protocol: Claimant, Stepper, Rebind):\n" + "\n".join(bad)
    )


def test_the_optimizer_check_finds_planted_references():
    planted = {
        "a.py": "from ..optim.sharded import ShardedOptimizer\n",
        "b.py": "def f(opt):\n    opt.units_relaid()\n",
        "c.py": "# the optimizer steps these\nx = 'optimizer'\n",
    }
    found = {line.split(": ", 1)[1] for line in optimizer_references(planted)}
    assert found == {"optim.sharded", "ShardedOptimizer", "opt", "units_relaid"}, found  # (not c.py's words)


def test_no_module_keeps_a_registry_keyed_by_id():
    sources = _package_sources()
    assert len(sources) > 100
    bad = id_keyed_registries(sources)
    assert not bad, (
        "module-level registries keyed by id() (keep the state in the package's own objects, "
        "or a weak set of live objects that answer for themselves):\n" + "\n".join(bad)
    )


def test_the_registry_check_finds_planted_ones():
    planted = {
        "r.py": (
            "import weakref\nfrom torch.utils.weak import WeakIdKeyDictionary\n_A = {}\n_B = set()\n"
            "_C = WeakIdKeyDictionary()\n"
            "def f(p, local):\n    _A[id(p)] = p\n    _B.add(id(p))\n    x = id(p) in _A\n"
            "    local[id(p)] = 1\n    return _A.get(id(p)), x\n"
        )
    }
    assert sorted(id_keyed_registries(planted)) == [
        "r.py:11: _A",
        "r.py:5: WeakIdKeyDictionary()",
        "r.py:7: _A",
        "r.py:8: _B",
        "r.py:9: _A",
    ], id_keyed_registries(planted)
