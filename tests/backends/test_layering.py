"""The package's layering, read from its source: no import cycle, ops below the backends, layers and
models calling the backend they are given, ``jax.default_backend()`` asked in one place."""

import ast
import functools
import pathlib


import transformer_jax

ROOT = pathlib.Path(transformer_jax.__file__).parent
PACKAGE = "transformer_jax"
# Where the platform may be asked: the backends, and the command line (which starts the process).
PLATFORM_ASKED_IN = ("transformer_jax.backends", "transformer_jax.cli")


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


@functools.cache
def trees() -> dict[str, ast.Module]:
  """Every module's syntax tree (parsed on first use, not when pytest collects this file)."""
  return {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _resolve(module: str, node: ast.ImportFrom) -> str:
  """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
  if not node.level:
    return node.module or ""
  base = module.split(".")
  if not MODULES[module].name == "__init__.py":
    base = base[:-1]
  base = base[: len(base) - node.level + 1]
  return ".".join(base + ([node.module] if node.module else []))


def imports(module: str) -> set[str]:
  """The package's modules ``module`` imports, anywhere in its source (function-local imports
  included): ``from pkg import name`` counts as ``pkg.name`` where that is a module, else
  ``pkg``."""
  out = set()
  for node in ast.walk(trees()[module]):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
    elif isinstance(node, ast.ImportFrom):
      target = _resolve(module, node)
      if target.split(".")[0] != PACKAGE:
        continue
      for alias in node.names:
        sub = f"{target}.{alias.name}"
        out.add(sub if sub in MODULES else target)
  return {m for m in out if m in MODULES and m != module}


@functools.cache
def graph() -> dict[str, set[str]]:
  """Which of the package's modules each module imports."""
  return {m: imports(m) for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Every strongly connected group of more than one module (Tarjan's algorithm), each sorted."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        group.append(w)
        if w == v:
          break
      if len(group) > 1:
        out.append(sorted(group))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_cycles_are_found():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
  assert cycles(graph) == [["a", "b", "c"]]
  assert cycles({"a": {"b"}, "b": set()}) == []


def _under(module: str, *prefixes: str) -> bool:
  return any(module == p or module.startswith(p + ".") for p in prefixes)


# Import cycles of the package outside the kernels' layers, listed exactly: a new cycle fails the
# test, and so does a listed one that no longer exists (drop it here).
LISTED_CYCLES = []


def test_no_import_cycle_but_the_listed_ones():
  assert cycles(graph()) == LISTED_CYCLES


def test_no_import_cycle_through_the_kernels_layers():
  core = [f"{PACKAGE}.{p}" for p in ("ops", "parallel", "backends", "layers", "models")]
  assert [c for c in cycles(graph()) if any(_under(m, *core) for m in c)] == []


def test_ops_imports_no_backend_and_layers_only_the_backends_interface():
  backends_pkg = f"{PACKAGE}.backends"
  for module, targets in graph().items():
    if _under(module, f"{PACKAGE}.ops", f"{PACKAGE}.parallel"):
      assert not any(_under(t, backends_pkg) for t in targets), module
    if _under(module, f"{PACKAGE}.layers", f"{PACKAGE}.models"):
      inner = [t for t in targets if _under(t, backends_pkg) and t != backends_pkg]
      assert inner == [], (module, inner)
  assert f"{PACKAGE}.cpu" not in MODULES  # the CPU machinery lives in backends.cpu


def test_default_backend_is_asked_only_by_the_backends_and_the_cli():
  askers = sorted(
    module
    for module, tree in trees().items()
    for node in ast.walk(tree)
    if isinstance(node, ast.Call)
    and isinstance(node.func, ast.Attribute)
    and node.func.attr == "default_backend"
    and not _under(module, *PLATFORM_ASKED_IN)
  )
  assert askers == []


def test_the_checks_see_the_imports_they_look_for():
  # Guards against a reader that finds nothing: known edges are seen, function-local ones too.
  assert f"{PACKAGE}.backends" in graph()[f"{PACKAGE}.layers.dense"]
  assert f"{PACKAGE}.backends.cudnn" in graph()[f"{PACKAGE}.backends.base"]
  assert f"{PACKAGE}.ops.dispatch" in graph()[f"{PACKAGE}.ops.attention"]
