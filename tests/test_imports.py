"""The package's import structure: no module reaches into another's private names, and the
public entry points live where the README says."""

import ast
import os

import transformer_jax as tj

PACKAGE = os.path.dirname(os.path.abspath(tj.__file__))

# (module file, private name): a kernel's second form sharing the first form's argument checks.
ALLOWED = {
  ("ops/ssm_pallas.py", "_check_chunk"),
  ("ops/ssm_pallas.py", "_check_mask"),
  ("ops/ssm_pallas.py", "_masked_dt"),
  ("ops/ssm_pallas.py", "_clamped_dt"),
}


def _private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def private_uses(source: str) -> list[tuple[int, str]]:
  """``(line, text)`` of each private name of another package module a module's source uses:
  ``from transformer_jax.a import _b`` and ``a._b`` where ``a`` was imported from the package."""
  tree = ast.parse(source)
  imported, out = set(), []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformer_jax"):
      for alias in node.names:
        if _private(alias.name):
          out.append((node.lineno, f"from {node.module} import {alias.name}"))
        else:
          imported.add(alias.asname or alias.name)
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith("transformer_jax"):
          imported.add(alias.asname or alias.name.split(".")[0])
  for node in ast.walk(tree):
    if (
      isinstance(node, ast.Attribute)
      and _private(node.attr)
      and isinstance(node.value, ast.Name)
      and node.value.id in imported
    ):
      out.append((node.lineno, f"{node.value.id}.{node.attr}"))
  return out


def test_the_scan_finds_both_spellings():
  src = (
    "from transformer_jax.ops import ssm as s\nfrom transformer_jax.x import _y\n"
    "import transformer_jax\ns._z(1)\ntransformer_jax.__version__\nlocal._w\n"
  )
  assert private_uses(src) == [(2, "from transformer_jax.x import _y"), (4, "s._z")]


def test_no_module_imports_another_modules_private_names():
  found = []
  for folder, _, files in os.walk(PACKAGE):
    for name in sorted(files):
      if not name.endswith(".py"):
        continue
      path = os.path.join(folder, name)
      rel = os.path.relpath(path, PACKAGE).replace(os.sep, "/")
      with open(path) as f:
        for line, text in private_uses(f.read()):
          if (rel, text.rsplit(" ", 1)[-1].rsplit(".", 1)[-1]) not in ALLOWED:
            found.append(f"transformer_jax/{rel}:{line}: {text}")
  assert found == [], "private names used across modules:\n" + "\n".join(found)


def test_loading_a_run_is_a_library_call():
  from transformer_jax import runs

  assert tj.load_run is runs.load_run and tj.load_model is runs.load_model
  assert runs.load_run.__module__ == "transformer_jax.runs.load"


def imports_of(target: str, *, outside: tuple[str, ...]) -> list[str]:
  """``file:line: module`` of each import of the package's ``target`` (``"bench"``: the module or
  package ``transformer_jax.bench`` and what is under it) by a module outside the folders
  ``outside``: ``import transformer_jax.bench``, ``from transformer_jax.bench.x import y`` and
  ``from transformer_jax import bench`` alike."""
  full = f"transformer_jax.{target}"
  found = []
  for folder, _, files in os.walk(PACKAGE):
    rel_folder = os.path.relpath(folder, PACKAGE).replace(os.sep, "/")
    if any(rel_folder == o or rel_folder.startswith(o + "/") for o in outside):
      continue
    for name in files:
      rel = f"{rel_folder}/{name}".removeprefix("./")
      if not name.endswith(".py"):
        continue
      with open(os.path.join(folder, name)) as f:
        tree = ast.parse(f.read())
      for node in ast.walk(tree):
        names = (
          [node.module or ""]
          if isinstance(node, ast.ImportFrom)
          else [a.name for a in node.names]
          if isinstance(node, ast.Import)
          else []
        )
        imported = [n for n in names if n == full or n.startswith(full + ".")]
        if isinstance(node, ast.ImportFrom) and node.module == "transformer_jax":
          imported += [a.name for a in node.names if a.name == target]
        found += [f"transformer_jax/{rel}:{node.lineno}: {n}" for n in imported]
  return found


def test_the_import_scan_finds_every_spelling(tmp_path, monkeypatch):
  (tmp_path / "lib").mkdir()
  (tmp_path / "cli").mkdir()
  (tmp_path / "lib" / "a.py").write_text(
    "import transformer_jax.cli\nfrom transformer_jax.cli.info import x\n"
    "from transformer_jax import cli, models\nfrom transformer_jax import client\n"
    "import transformer_jax.client\n"
  )
  (tmp_path / "cli" / "b.py").write_text("from transformer_jax import cli\n")
  monkeypatch.setattr(f"{__name__}.PACKAGE", str(tmp_path))
  assert imports_of("cli", outside=("cli",)) == [
    "transformer_jax/lib/a.py:1: transformer_jax.cli",
    "transformer_jax/lib/a.py:2: transformer_jax.cli.info",
    "transformer_jax/lib/a.py:3: cli",
  ]


def test_the_library_does_not_import_the_benchmarks():
  # The benchmarks sit on top of the library; only they and the command line import them.
  found = imports_of("bench", outside=("bench", "cli"))
  assert found == [], "the library imports the benchmarks:\n" + "\n".join(found)


def test_the_library_does_not_import_the_command_line():
  # The command line (transformer_jax.cli) sits on top of everything: it holds the arguments, the
  # printing and the exit codes; what a Python user calls lives below it.
  found = imports_of("cli", outside=("cli",))
  assert found == [], "the library imports the command line:\n" + "\n".join(found)
