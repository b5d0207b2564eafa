"""The package's shape, checked on its source: its parts import only the parts
below them (the layering of docs/architecture.md) and no module imports itself
through others; no file over 500 lines of code, no class over 300, no function
body over 60, and no module reading or writing another object's underscore
attributes. A line of code is one that is neither blank nor only a comment; a
function's size is its body's, its signature and docstring left out: the
formatter's layout (one argument a line where a call does not fit) and the
explanations beside the code do not count against it."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "python", "zeroshard")
MAX_FILE, MAX_CLASS, MAX_FUNCTION = 500, 300, 60

# The parts, each a folder of the package, and the parts each may import
# (docs/architecture.md draws it; each folder's __init__ docstring repeats its row).
# The package's own __init__.py (the public API) may import every part;
# integrations (adapters for other tools) only the public API.
BELOW_OPTIM = {"native", "comm", "offload", "core", "zero12", "zero3"}
LAYERS = {
    "native": set(),  # the C++ core's bindings
    "comm": {"native"},  # collectives, flight record, watchdog, groups
    "offload": {"native"},  # where state lives, the streamed CPU step
    "core": {"native", "comm", "offload"},  # the shard-source interface, the reduction pipeline
    "zero12": {"native", "comm", "offload", "core"},  # the ZeRO-1/2 gradient source
    "zero3": {"native", "comm", "offload", "core"},  # FullyShard and its units
    "optim": BELOW_OPTIM,  # the update engine
    "checkpoint": {"native", "comm", "core", "optim"},  # through regions: neither stage
    "plan": BELOW_OPTIM | {"optim"},  # the memory planner
}

# What adapters for other tools (integrations/) and the thin modules at the package's top
# (e.g. zero_to_fp32.py, which delegates to an integration) may import: the public API, i.e.
# the root package and its public modules (thin modules also the integrations they front).
PUBLIC = {"zeroshard", "zeroshard.comm", "zeroshard.checkpoint", "zeroshard.plan"}

# torch internals with no public equivalent, allowed where they are needed:
# autograd's end-of-backward callback, the nn.Module slots a parameter is
# swapped into and out of, autograd's current graph task, the return type
# of nn.Module.load_state_dict, the default c10d store (check-ins that must
# not go through the communicator), the wrapper-subclass constructor of
# p.grad's placeholder and the aten ops it answers, and the fused per-tensor
# norm torch's own clip_grad_norm_ calls (torch.nn.utils.get_total_norm
# returns only the total; the statistics need each parameter's), and the
# foreach zero and copy that fill a flat buffer in a few launches.
TORCH_INTERNALS = {
    "_execution_engine",
    "_parameters",
    "_buffers",
    "_modules",
    "_C",
    "_current_graph_task_id",
    "_IncompatibleKeys",
    "_get_default_store",
    "_make_wrapper_subclass",
    "_disabled_torch_function_impl",
    "_foreach_mul_",
    "_foreach_zero_",
    "_amp_foreach_non_finite_check_and_unscale_",
    "_foreach_clamp_min_",
    "_foreach_norm",
    "_foreach_copy_",
    "_foreach_clamp_max_",
    "_to_copy",
    "_get_backend",
    "_timeout",
    "_schema",  # (an aten op's schema: whether it writes its arguments, for p.grad reads)
    "_init_from_local_shards_and_global_metadata",  # (DCP state dicts: one layout exchange)
    "_join_config",  # (torch's Joinable: whether a Join is enabled, read by its part)
    "_version",  # (a tensor's in-place write counter: construction code that wrote a sharded parameter)
    # (whether a model has load_state_dict hooks: torch's own load_state_dict then runs them)
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
    "_non_persistent_buffers_set",  # (a module's buffers its state dict leaves out)
}

# Known exceptions, each of which must still be over its limit (so the list
# cannot go stale): none.
PENDING: set = set()


def _sources(package=PACKAGE):
    """{path relative to the package: source} of every module, in subfolders too."""
    found = {}
    for folder, _, files in os.walk(package):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    found[os.path.relpath(path, package)] = f.read()
    return found


def _is_super(node) -> bool:
    """``super()``: the object's own (inherited) attribute, e.g. an overridden hook's base."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


# a class or function may be longer with a reason, on the line right above its first
# (its first decorator's): "# longer: <why splitting it would hide what it does>"
_PY_LONGER = re.compile(r"^\s*#\s*longer:(.*)$")
LONGER: dict = {}  # ("class"/"function", "file:name") -> (lines, reason), filled by _violations


def _code_lines(lines: list, first: int, last: int, skip=range(0)) -> int:
    """How many of ``lines`` [first, last] (1-based) hold code: not blank, not only a
    comment, not in ``skip``."""
    return sum(
        1
        for n in range(first, last + 1)
        if n not in skip and lines[n - 1].strip() and not lines[n - 1].lstrip().startswith("#")
    )


def _size(node, lines: list) -> int:
    """A class's lines of code; a function's body's, without its docstring."""
    if isinstance(node, ast.ClassDef):
        return _code_lines(lines, node.lineno, node.end_lineno)
    first = node.body[0]
    doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    return _code_lines(
        lines, first.lineno, node.end_lineno, range(first.lineno, first.end_lineno + 1) if doc else range(0)
    )


def _sized(found: dict, kind: str, key: str, node, lines: list, limit: int) -> None:
    """Record ``node`` (a class or function of ``lines``) if over ``limit`` without a
    "longer:" line giving a reason, or if such a line is wrong (no reason, within the limit)."""
    size = _size(node, lines)
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    said = _PY_LONGER.match(lines[first - 2]) if first > 1 else None
    reason = said.group(1).strip() if said else ""
    if said and not reason:
        found[(kind + " whose 'longer:' gives no reason", key)] = size
    elif said and size <= limit:
        found[(kind + " 'longer:' within its limit", key)] = size
    elif said:
        LONGER[(kind, key)] = (size, reason)
    elif size > limit:
        found[(kind, key)] = size


def _violations(package=PACKAGE):
    found = {}
    LONGER.clear()
    for name, src in sorted(_sources(package).items()):
        lines = src.splitlines()
        if _code_lines(lines, 1, len(lines)) > MAX_FILE:
            found[("file", name)] = _code_lines(lines, 1, len(lines))
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ClassDef):
                _sized(found, "class", f"{name}:{node.name}", node, lines, MAX_CLASS)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                _sized(found, "function", f"{name}:{node.name}", node, lines, MAX_FUNCTION)
            elif (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and node.attr not in TORCH_INTERNALS
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                and not _is_super(node.value)
            ):
                found[("private", f"{name}:{node.lineno}:{ast.unparse(node)}")] = 1
    return found


def test_no_file_class_or_function_over_its_limit_and_no_foreign_private_access():
    found = _violations()
    new = {k: v for k, v in found.items() if k not in PENDING}
    allowed = "".join(f"\n  {k[1]} ({n} lines): {why}" for k, (n, why) in sorted(LONGER.items()))
    assert not new, (
        f"over the limits (file {MAX_FILE}, class {MAX_CLASS}, function body {MAX_FUNCTION} lines of code) "
        f"or touching another object's underscore attribute: {new}; longer, each with its "
        f"reason:{allowed or ' none'}"
    )
    done = PENDING - set(found)
    assert not done, f"now within the limits: remove {sorted(done)} from PENDING"


def test_the_checker_finds_planted_violations(tmp_path):
    body = "\n".join(f"    x{i} = o._x + self._y + o.__len__() + super()._z" for i in range(61))
    # blank lines, comments and the docstring do not count; each statement's line does
    doc = '    """Doc.\n\n    string."""\n    # a comment\n\n'
    (tmp_path / "big.py").write_text("def f(self, o):\n" + doc + body + "\n" + "\n# said\n" * 440 + "y = 1\n" * 437)
    found = _violations(str(tmp_path))
    assert found[("file", "big.py")] == 501 and found[("function", "big.py:f")] == 61, found  # (1 + 2 + 61 + 437)
    privates = [k for k in found if k[0] == "private"]
    assert len(privates) == 61 and all(k[1].endswith("o._x") for k in privates)  # not self._y, not dunders
    assert set(LAYERS) <= set(os.listdir(PACKAGE))
    # a "longer:" line lets a class or function be longer only with a reason, and only if it is
    wide = "class C:\n" + "    x = 1\n" * MAX_CLASS
    (tmp_path / "big.py").write_text(
        "# longer: a facade\n" + wide + "# longer:\n" + wide + "# longer: short\n"
        "def g():\n    pass\n\n\n# longer: it reads best whole\n@staticmethod\n"
        "def h():\n" + "    y = 1\n" * (MAX_FUNCTION + 1)
    )
    found = _violations(str(tmp_path))
    assert {k: v for k, v in found.items() if k[0] != "file"} == {
        ("class whose 'longer:' gives no reason", "big.py:C"): MAX_CLASS + 1,
        ("function 'longer:' within its limit", "big.py:g"): 1,
    }, found
    assert LONGER[("function", "big.py:h")] == (MAX_FUNCTION + 1, "it reads best whole"), LONGER


COMPILED = "zeroshard._C"  # the extension built from csrc/: the native part's, loaded by native/ext.py


def _module_name(rel: str) -> str:
    """ "zero3/gather.py" -> "zeroshard.zero3.gather"; "comm/__init__.py" -> "zeroshard.comm"."""
    parts = ["zeroshard"] + rel[:-3].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _lazy_exports(tree, rel: str) -> set:
    """The import nodes of a package's PEP 562 ``__getattr__`` (a lazy re-export, e.g. the
    root's ``zeroshard.initialize``): they run on first use of the name, never while the
    package imports, so they make no import cycle."""
    if not rel.endswith("__init__.py"):
        return set()
    return {id(n) for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "__getattr__" for n in ast.walk(f)}


def _imports(sources):
    """{module: {zeroshard module it imports}}, relative and absolute imports alike, at
    any depth in the file (an import inside a function is an import too, except in a
    package's lazy ``__getattr__``). ``from . import x`` is an import of the module x where
    x is one, else of the package."""
    modules = {_module_name(rel): rel for rel in sources}
    graph = {}
    for rel, src in sources.items():
        me = _module_name(rel)
        package = me if rel.endswith("__init__.py") else me.rpartition(".")[0]
        targets = set()
        tree = ast.parse(src)
        lazy = _lazy_exports(tree, rel)
        for node in ast.walk(tree):
            if id(node) in lazy:
                continue
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = (base + "." + node.module if node.module else base) if node.level else node.module
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules or sub == COMPILED else base)
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[me] = {t for t in targets if (t in modules or t == COMPILED) and t != me}
    return graph


def _part(module: str):
    """The part (folder) a module belongs to; None for the package's own __init__."""
    if module == COMPILED:
        return "native"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _thin_modules(sources) -> set:
    """The modules at the package's top that are not parts (files, not folders)."""
    return {_module_name(rel) for rel in sources if os.sep not in rel and rel != "__init__.py"}


def _layer_violations(graph, layers=LAYERS, thin=frozenset()):
    bad = []
    for mod, targets in sorted(graph.items()):
        mine = _part(mod)
        if mine is None:
            continue
        for t in sorted(targets):
            theirs = _part(t)
            if theirs == mine:
                continue
            if mine == "integrations":
                ok, rule = t in PUBLIC, f"the public API only: {sorted(PUBLIC)}"  # adapters at the edge
            elif mod in thin:
                ok, rule = t in PUBLIC or theirs == "integrations", "the public API and integrations only"
            else:
                ok, rule = mine in layers and theirs in layers[mine], sorted(layers.get(mine, ()))
            if not ok:
                bad.append(f"{mod} imports {t} ({mine} may import {rule})")
    return bad


def _cycles(graph):
    """One cycle per strongly connected component of more than one module."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_part_imports_only_the_parts_below_it_and_nothing_imports_itself_back():
    sources = _sources()
    folders = {rel.split(os.sep)[0] for rel in sources if os.sep in rel}
    assert folders - {"integrations"} == set(LAYERS), f"a folder without a row in LAYERS, or the reverse: {folders}"
    graph = _imports(sources)
    assert sum(len(t) for t in graph.values()) > 80  # the parser sees the package's imports
    bad = _layer_violations(graph, thin=_thin_modules(sources))
    assert not bad, "imports against the layering:\n" + "\n".join(bad)
    assert not _cycles(graph), f"import cycles: {_cycles(graph)}"
    for folder in folders:  # each part says what it does and may import
        doc = ast.get_docstring(ast.parse(sources[os.path.join(folder, "__init__.py")])) or ""
        assert "May import" in doc, f"{folder}/__init__.py's docstring must say what the part may import"


def test_the_layering_check_finds_planted_violations(tmp_path):
    pkg = tmp_path / "pkg"
    for folder, body in {
        "native": "from ..optim import x\n",
        "optim": "from ..native import kernels\n",
        "comm": "from . import a\n",
        "integrations": "from ..optim import x\nimport zeroshard\n",
    }.items():
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text(body)
    (pkg / "native" / "kernels.py").write_text("")
    (pkg / "optim" / "x.py").write_text("")
    (pkg / "comm" / "a.py").write_text("from . import b\n")
    (pkg / "comm" / "b.py").write_text("def f():\n    from .a import g\n")  # a cycle through a function-level import
    (pkg / "__init__.py").write_text("from .optim import x\n")
    graph = _imports(_sources(str(pkg)))
    bad = _layer_violations(graph)
    assert any(b.startswith("zeroshard.native imports zeroshard.optim.x") for b in bad)
    assert any(b.startswith("zeroshard.integrations imports zeroshard.optim.x") for b in bad)
    assert not any(b.startswith(("zeroshard.optim ", "zeroshard imports")) for b in bad), bad
    assert _cycles(graph) == [["zeroshard.comm.a", "zeroshard.comm.b"]]


NOTE = re.compile(r"\[Note: ([^\]\n]+)\]")
# a Note is written where its tag starts a line (after a comment marker), not followed by
# "in <file>", ")" or ":" (those are citations that wrapped onto a new line)
NOTE_WRITTEN = re.compile(r'^\s*(?:#|//|\*|"""|/\*)?\s*\[Note: ([^\]]+)\](?!\s+in\b|\)|:|,)', re.M)


def _notes_written():
    """{note: [files where it is written]} over the package, csrc/ and CMakeLists.txt."""
    paths = [os.path.join(PACKAGE, rel) for rel in _sources()] + [os.path.join(ROOT, "CMakeLists.txt")]
    for folder, _, files in os.walk(os.path.join(ROOT, "csrc")):
        paths += [os.path.join(folder, f) for f in files if f.endswith((".h", ".cpp", ".cu"))]
    written = {}
    for path in paths:
        with open(path, errors="replace") as f:
            for name in NOTE_WRITTEN.findall(f.read()):
                written.setdefault(name, []).append(os.path.relpath(path, ROOT))
    return written


def test_the_note_index_lists_every_note_where_it_is_written():
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        rows = re.findall(r"^\| \[Note: ([^\]]+)\] \| `([^`]+)` \|", f.read(), re.M)
    index = dict(rows)
    assert len(index) == len(rows), "a Note is listed twice in docs/architecture.md"
    written = _notes_written()
    assert len(written) > 20
    assert sorted(set(written) - set(index)) == [], "Notes missing from docs/architecture.md's index"
    assert sorted(set(index) - set(written)) == [], "the index lists Notes no source writes"
    for name, path in index.items():
        assert path in written[name], f"[Note: {name}] is written in {written[name]}, not {path}"
    cited = set()
    for folder in (PACKAGE, os.path.join(ROOT, "csrc"), os.path.join(ROOT, "tests")):
        for dirpath, _, files in os.walk(folder):
            for f in files:
                if f.endswith((".py", ".h", ".cpp", ".cu")) and f != "test_structure.py":
                    with open(os.path.join(dirpath, f), errors="replace") as fh:
                        cited |= set(NOTE.findall(fh.read()))
    assert sorted(cited - set(written)) == [], "Notes cited but written nowhere"


def test_the_public_api_rule_finds_planted_violations(tmp_path):
    """integrations/ and thin top-level modules may import the public API (the root and its
    public modules) only; a root's lazy __getattr__ re-export of an integration is no cycle."""
    pkg = tmp_path / "pkg"
    for folder in ("checkpoint", "optim", "integrations"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "checkpoint" / "api.py").write_text("")
    (pkg / "optim" / "x.py").write_text("")
    (pkg / "integrations" / "tool.py").write_text(
        "import zeroshard\nfrom zeroshard import checkpoint\nfrom zeroshard.checkpoint import api\n"
    )
    (pkg / "front.py").write_text("from .integrations import tool\nfrom .optim import x\n")
    (pkg / "__init__.py").write_text(
        "from .optim import x\ndef __getattr__(name):\n    from .integrations import tool\n    return tool\n"
    )
    sources = _sources(str(pkg))
    graph = _imports(sources)
    bad = _layer_violations(graph, thin=_thin_modules(sources))
    assert [b.split(" (")[0] for b in bad] == [
        "zeroshard.front imports zeroshard.optim.x",
        "zeroshard.integrations.tool imports zeroshard.checkpoint.api",
    ], bad
    assert _cycles(graph) == []  # the lazy re-export is not an import
    (pkg / "__init__.py").write_text("from .optim import x\nfrom .integrations import tool\n")
    assert _cycles(_imports(_sources(str(pkg)))) == [["zeroshard", "zeroshard.integrations.tool"]]


# optional tools that only their own adapter (integrations/<tool>/) may import
OPTIONAL_TOOLS = {
    "lightning": "integrations/lightning",
    "pytorch_lightning": "integrations/lightning",
    "deepspeed": "integrations/deepspeed",
}


def _tool_imports(sources) -> list:
    """(module file, tool) for every import of an optional tool outside its adapter."""
    found = []
    for rel, src in sorted(sources.items()):
        for node in ast.walk(ast.parse(src)):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                else []
            )
            for name in names:
                tool = name.split(".")[0]
                if tool in OPTIONAL_TOOLS and not rel.startswith(OPTIONAL_TOOLS[tool] + os.sep):
                    found.append((rel, tool))
    return found


def test_only_its_adapter_imports_an_optional_tool(tmp_path):
    assert _tool_imports(_sources()) == []
    (tmp_path / "optim").mkdir()
    (tmp_path / "optim" / "x.py").write_text("def f():\n    import lightning.pytorch as pl\n")
    (tmp_path / "integrations" / "lightning").mkdir(parents=True)
    (tmp_path / "integrations" / "lightning" / "s.py").write_text("from lightning.pytorch import Trainer\n")
    assert _tool_imports(_sources(str(tmp_path))) == [(os.path.join("optim", "x.py"), "lightning")]


# ----------------------------------------------------- one reduction pipeline
# The calls that issue a gradient reduction, and the module allowed to make them.
REDUCING_CALLS = {"reduce_scatter", "all_reduce"}
PIPELINE = os.path.join("core", "reduction.py")
# the gradient sources, each of which must run its reductions on the pipeline
SOURCES_ON_PIPELINE = (os.path.join("zero12", "reducer.py"), os.path.join("zero3", "backward.py"))


def _reductions_outside_pipeline(sources: dict) -> list:
    """Calls to reduce_scatter / all_reduce in the stage folders (zero12/, zero3/), and
    gradient sources that do not build a ReductionPipeline."""
    bad = []
    for rel, src in sources.items():
        if rel.split(os.sep)[0] not in ("zero12", "zero3"):
            continue
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name in REDUCING_CALLS:
                    bad.append(f"{rel}:{node.lineno}: {name}() outside {PIPELINE}")
    for rel in SOURCES_ON_PIPELINE:
        src = sources.get(rel, "")
        if "ReductionPipeline(" not in src or "from ..core.reduction import" not in src:
            bad.append(f"{rel}: does not reduce on {PIPELINE}'s ReductionPipeline")
    return bad


def test_every_stage_reduces_on_the_one_pipeline():
    sources = _sources()
    called = {
        n.func.attr
        for n in ast.walk(ast.parse(sources[PIPELINE]))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    }
    assert REDUCING_CALLS <= called  # the pipeline is where they are
    bad = _reductions_outside_pipeline(sources)
    assert not bad, "reduction code outside the pipeline:\n" + "\n".join(bad)


def test_the_pipeline_check_finds_planted_violations():
    planted = dict(_sources())
    planted[os.path.join("zero3", "extra.py")] = "def f(t):\n    comm.reduce_scatter(t, t)\n"
    planted[os.path.join("zero12", "reducer.py")] = "x = 1\n"
    bad = _reductions_outside_pipeline(planted)
    assert any("extra.py:2: reduce_scatter()" in b for b in bad), bad
    assert any(b.startswith(os.path.join("zero12", "reducer.py") + ":") for b in bad), bad


# ------------------------------------------------------------------ csrc/ sizes
CSRC = os.path.join(ROOT, "csrc")
# what the C++ size check blanks before it matches braces: comments, string and
# character literals (raw strings too) and preprocessor lines with their continuations
_CPP_NOISE = re.compile(
    r'//[^\n]*|/\*.*?\*/|R"([^(\s]*)\(.*?\)\1"|"(?:\\.|[^"\\\n])*"'
    r"|'(?:\\.|[^'\\\n])*'|^[ \t]*#(?:\\\n|[^\n])*",
    re.DOTALL | re.MULTILINE,
)
# the head of a brace (its text since the last ";", "{" or "}") that opens a function's
# body: a closing ")" then only qualifiers or a trailing return type; or a constructor's
# initializer list (whose members' own "{...}" follow a name)
_CPP_SIGNATURE = re.compile(
    r"\)\s*((const|volatile|noexcept|override|final|mutable|try|&&?)\s*)*$"
    r"|\)\s*((const|noexcept)\s*)*->[^;=]*$"
)
_CPP_INITIALIZERS = re.compile(r"\)\s*(noexcept\s*)?:(?!:)")
_CPP_CLASS = re.compile(r"^(template\s*<.*>\s*)?(class|struct|union|enum)\b", re.DOTALL)
_CPP_NAMESPACE = re.compile(r"^((inline\s+)?namespace|extern)\b")
_CPP_ACCESS = re.compile(r"^(\s*(public|private|protected)\s*:)+")
# a function (or class) may be longer with a reason, on the line right above its first:
#   // longer: <why splitting it would hide what it does>
_CPP_LONGER = re.compile(r"^\s*//\s*longer:(.*)$")


def _blank(match) -> str:
    """The match with all but its newlines turned to spaces, so offsets and lines hold."""
    return re.sub(r"[^\n]", " ", match.group())


def _opened_by(head: str) -> str:
    """What a "{" after `head` (at namespace or class scope) opens."""
    if head.endswith("=") or _CPP_INITIALIZERS.search(head) and re.search(r"\w$", head):
        return "initializer"  # a variable's value, or a member's in a constructor's initializer list
    if _CPP_SIGNATURE.search(head) or _CPP_INITIALIZERS.search(head):
        return "function"
    if _CPP_CLASS.match(head):
        return "class"
    return "namespace" if _CPP_NAMESPACE.match(head) else "initializer"


def _cpp_name(kind: str, head: str) -> str:
    """A function's name (the last name called at the top of its signature, before any
    initializer list or trailing return type) or a class's."""
    if kind != "function":
        return "".join(
            re.findall(r"^(?:template\s*<.*>\s*)?(?:class|struct|union|enum)\s+(?:class\s+)?(\w*)", head, re.DOTALL)[:1]
        )
    head = re.split(r"\)\s*(?:noexcept\s*)?:(?!:)|->", head)[0]
    top = [
        m
        for m in re.finditer(r"(operator\s*(?:\(\)|[^\s\w(]+)|[\w:~]+)\s*\(", head)
        if head[: m.start()].count("(") == head[: m.start()].count(")")
    ]
    return top[-1].group(1) if top else ""


def _cpp_bodies(text: str):
    """(kind, name, first line, last line) of every function and class in C++ source
    `text` (lines from 1), at file scope, in namespaces and in classes: a function runs
    from the first line of its signature to its closing brace, with all inside it
    (lambdas, local classes), a class from its first line to its closing brace."""
    code = _CPP_NOISE.sub(_blank, text)
    stack, head, paren = [], 0, 0  # the open braces (kind, name, first line); where the head starts; "(" depth
    for m in re.finditer(r"[{}();]", code):
        c, k = m.group(), m.start()
        inside = stack and stack[-1][0] in ("function", "block", "initializer")  # then braces only
        if c == "}":
            kind, name, first = stack.pop()
            if kind in ("function", "class"):
                yield kind, name, first, code.count("\n", 0, k) + 1
            if kind != "block" and kind != "initializer":
                head = k + 1
        elif inside:
            if c == "{":
                stack.append(("block", "", 0))
        elif c in "()":
            paren += 1 if c == "(" else -1
        elif c == ";" and not paren:
            head = k + 1
        elif c == "{":
            text_head = _CPP_ACCESS.sub("", code[head:k]).strip()
            first = code.count("\n", 0, head + code[head:k].find(text_head) if text_head else k) + 1
            kind = "initializer" if paren else _opened_by(text_head)
            stack.append((kind, _cpp_name(kind, text_head), first))
            if kind != "initializer":
                head = k + 1
    assert not stack and not paren, f"unbalanced braces or parentheses: {stack}"


def _cpp_violations(root=CSRC):
    """C++ files over MAX_FILE lines and functions over MAX_FUNCTION (classes over
    MAX_CLASS), the sizes the Python rule holds, with those a "longer:" line lets be
    longer: ({(kind, "file:line name"): lines}, {(kind, "file:line name"): (lines, reason)}).
    A "longer:" line without a reason, or on one within its limit, is a violation."""
    found, longer = {}, {}
    for folder, _, files in os.walk(root):
        for f in sorted(files):
            if not f.endswith((".h", ".cpp", ".cu")):
                continue
            path = os.path.join(folder, f)
            rel = os.path.relpath(path, root)
            with open(path) as fh:
                text = fh.read()
            lines = text.splitlines()
            if len(lines) > MAX_FILE:
                found[("file", rel)] = len(lines)
            for kind, name, first, last in _cpp_bodies(text):
                size, limit = last - first + 1, MAX_CLASS if kind == "class" else MAX_FUNCTION
                key = (kind, f"{rel}:{first} {name}")
                said = _CPP_LONGER.match(lines[first - 2]) if first > 1 else None
                reason = said.group(1).strip() if said else ""
                if said and not reason:
                    found[(kind + " whose 'longer:' gives no reason", key[1])] = size
                elif said and size <= limit:
                    found[(kind + " 'longer:' within its limit", key[1])] = size
                elif said:
                    longer[key] = (size, reason)
                elif size > limit:
                    found[key] = size
    return found, longer


def test_no_cpp_file_or_function_over_its_limit():
    found, longer = _cpp_violations()
    seen = set()
    for name in ("layout.cpp", "layout.h", "io_engine.h"):
        with open(os.path.join(CSRC, name)) as fh:
            seen |= {f"{name} {kind} {what}" for kind, what, _, _ in _cpp_bodies(fh.read())}
    # it sees csrc/: functions in namespaces, signatures over lines, classes and their members
    assert {
        "layout.cpp function compute_layout",
        "layout.cpp function Layout::shard_pieces",
        "layout.h class Layout",
        "io_engine.h function depth",
    } <= seen, seen
    allowed = "".join(f"\n  {k[1]} ({n} lines): {why}" for k, (n, why) in sorted(longer.items()))
    assert not found, (
        f"csrc/ over the limits (file {MAX_FILE}, class {MAX_CLASS}, function {MAX_FUNCTION}): "
        f"{found}; longer, each with its reason:{allowed or ' none'}"
    )


def test_the_cpp_size_check_finds_planted_violations(tmp_path):
    body = "  x();\n" * MAX_FUNCTION
    planted = {
        "big.cpp": "int f() {\n" + body + "}\n" + "//\n" * MAX_FILE,
        "ok.h": "namespace a {\nstruct P p = {\n  1, 2};\nint g() {\n  return 1;\n}\n}  // namespace a\n",
        "wide.h": "struct S {\n" + "  int x;\n" * MAX_CLASS + "};\n",
        # a signature over lines, in namespaces, with a lambda and braces in a literal
        "spread.cpp": "#include <x>\nnamespace a {\nnamespace {\n\n"
        "std::vector<int> spread(const char* s = \"{\",\n                        int n) {\n"
        "  auto l = [&](int k) {\n" + body + "  };\n}\n\n}  // namespace\n}  // namespace a\n",
        # member functions: a constructor with an initializer list, the reasons given or not
        "member.h": "template <typename T>\nclass C : public B {\n public:\n"
        "  C(int n) : n_{n}, m_(n) {\n" + body + "  }\n"
        "  int h() const override { return '}'; }\n  // longer: a table that reads as one\n"
        "  void t() {\n" + body + "  }\n  //longer:\n  void u() {\n" + body + "  }\n"
        "  // longer: stale\n  void v() {}\n  int n_, m_;\n};\n",
    }
    for name, text in planted.items():
        (tmp_path / name).write_text(text)
    found, longer = _cpp_violations(str(tmp_path))
    long = MAX_FUNCTION + 2  # member.h: C's body, then t's (after h), u's and v's
    t, u, v = long + 6, 2 * long + 7, 3 * long + 8
    assert found == {
        ("file", "big.cpp"): MAX_FILE + long,
        ("function", "big.cpp:1 f"): long,
        ("class", "wide.h:1 S"): MAX_CLASS + 2,
        ("function", "spread.cpp:5 spread"): long + 3,
        ("function", "member.h:4 C"): long,
        ("function whose 'longer:' gives no reason", f"member.h:{u} u"): long,
        ("function 'longer:' within its limit", f"member.h:{v} v"): 1,
    }, found
    assert longer == {("function", f"member.h:{t} t"): (long, "a table that reads as one")}, longer


# ------------------------------------------------------------ names as they are
# The ecosystem's own abbreviations, the only names a module may be imported under
# other than its own (``import torch.distributed as dist``).
CONVENTIONAL = {"dist", "nn", "F", "np", "mp"}


def _renamed_imports(sources: dict) -> list:
    """Imports that give a module or name of the package a name of their own."""
    bad = []
    for rel, src in sources.items():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    own = alias.name.rsplit(".", 1)[-1]
                    if alias.asname not in (None, own) and alias.asname not in CONVENTIONAL:
                        bad.append(f"{rel}:{node.lineno}: {alias.name} as {alias.asname}")
    return bad


def test_no_module_is_imported_under_another_name():
    bad = _renamed_imports(_sources())
    assert not bad, "imported under another name (rename the module or the clashing variable):\n" + "\n".join(bad)
    planted = _renamed_imports({"x.py": "from . import wrap as setup\nimport torch.distributed as dist\n"})
    assert planted == ["x.py:1: wrap as setup"], planted


def test_no_scale_travels_with_a_gradient():
    """[Note: one meaning for a gradient]: every fold writes the averaged gradient into the
    GradShard its Reduction owns, and the kernels take it as it is: no ``grad_scale`` or
    ``grad_attr`` in the library or the C++ core, and a Segment reads a GradShard."""
    found = [
        f"{name}: {word}" for name, src in _sources().items() for word in ("grad_scale", "grad_attr") if word in src
    ]
    for folder, _, files in os.walk(CSRC):
        for name in files:
            with open(os.path.join(folder, name), errors="replace") as f:
                found += [f"csrc/{name}: grad_scale"] if "grad_scale" in f.read() else []
    assert not found, found
    from zeroshard.core.reduction import Reduction
    from zeroshard.core.segments import GradShard, Segment

    assert Segment.__dataclass_fields__["reduced"].type in ("GradShard", GradShard)
    assert Reduction.__dataclass_fields__["grad"].type in ("GradShard", GradShard)
