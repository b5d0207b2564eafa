"""The package's shape, checked on its source: no file over 500 lines, no class
over 300, no function over 60, and no module reading or writing another
object's underscore attributes (see the README's architecture section)."""
import ast
import os

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", "zeroshard")
MAX_FILE, MAX_CLASS, MAX_FUNCTION = 500, 300, 60

# torch internals with no public equivalent, allowed where they are needed:
# autograd's end-of-backward callback, the nn.Module slots a parameter is
# swapped into and out of, autograd's current graph task, the return type
# of nn.Module.load_state_dict, the default c10d store (check-ins that must
# not go through the communicator), the wrapper-subclass constructor of
# p.grad's placeholder and the aten ops it answers.
TORCH_INTERNALS = {"_execution_engine", "_parameters", "_buffers", "_modules", "_C", "_current_graph_task_id",
                   "_IncompatibleKeys", "_get_default_store", "_make_wrapper_subclass",
                   "_disabled_torch_function_impl", "_foreach_mul_", "_foreach_zero_",
                   "_amp_foreach_non_finite_check_and_unscale_", "_to_copy", "_get_backend", "_timeout"}

# Known exceptions, each of which must still be over its limit (so the list
# cannot go stale): none.
PENDING: set = set()


def _violations(package=PACKAGE):
    found = {}
    for name in sorted(os.listdir(package)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(package, name)) as f:
            src = f.read()
        lines = len(src.splitlines())
        if lines > MAX_FILE:
            found[("file", name)] = lines
        for node in ast.walk(ast.parse(src)):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and size > MAX_CLASS:
                found[("class", f"{name}:{node.name}")] = size
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > MAX_FUNCTION:
                found[("function", f"{name}:{node.name}")] = size
            elif (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                  and node.attr not in TORCH_INTERNALS
                  and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found[("private", f"{name}:{node.lineno}:{ast.unparse(node)}")] = 1
    return found


def test_no_file_class_or_function_over_its_limit_and_no_foreign_private_access():
    found = _violations()
    new = {k: v for k, v in found.items() if k not in PENDING}
    assert not new, f"over the limits (file {MAX_FILE}, class {MAX_CLASS}, function {MAX_FUNCTION} lines) " \
                     f"or touching another object's underscore attribute: {new}"
    done = PENDING - set(found)
    assert not done, f"now within the limits: remove {sorted(done)} from PENDING"


def test_the_checker_finds_planted_violations(tmp_path):
    body = "\n".join(f"    x{i} = o._x + self._y + o.__len__()" for i in range(61))
    (tmp_path / "big.py").write_text("def f(self, o):\n" + body + "\n" + "\n" * 440)
    found = _violations(str(tmp_path))
    assert found[("file", "big.py")] == 502 and found[("function", "big.py:f")] == 62
    privates = [k for k in found if k[0] == "private"]
    assert len(privates) == 61 and all(k[1].endswith("o._x") for k in privates)   # not self._y, not dunders
    assert {"sharded.py", "_reducer.py", "_units.py", "_shards.py"} <= set(os.listdir(PACKAGE))
