"""The package's wings: every module has a place in ``posbench.LEVELS`` (a wing, and a level inside it) and imports only
from the wings below its own or from lower levels of its own wing (imports inside functions counted); every wing's
``__init__`` is a docstring saying what lives there, what it may import and where to start, unless LEVELS places it;
every module imports alone in a fresh interpreter; no import cycle; and the only imports placed inside functions are
of the third-party packages whose import a run may skip, each with a comment on its line saying so: wandb and
matplotlib (when tracking or plotting is off), submitit (outside SLURM), datasets (with a warm data cache), scipy
(outside a report) and transformers (the hf extra: only where a pretrained checkpoint is read): each costs start-up
time that most processes never need.

The imports are read from the source with ``ast``, independently of any tool of the package.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "posbench"
LAZY_ALLOWED = ("wandb", "matplotlib", "submitit", "datasets", "scipy", "transformers", "huggingface_hub")


def modules() -> dict[str, Path]:
    """{dotted name: path} of every module of the package (a package's ``__init__`` under the package's name)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(name: str, path: Path, known: set[str]) -> list[tuple[str, bool, int]]:
    """(module of the package, inside a function?, line) of every import in ``path`` that names one; ``from P import m``
    of a module m names P.m (P's ``__init__`` runs first, as for every import of a submodule, and is not counted)."""
    tree = ast.parse(path.read_text())
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if n is not f}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out += [(t, id(node) in inside, node.lineno) for t in dict.fromkeys(targets) if t in known and t != name]
    return out


def levels_table() -> tuple:
    """``posbench.LEVELS``, read from the source with ``ast`` (no import of the package)."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    return next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.AnnAssign) and n.target.id == "LEVELS")


def wing_inits() -> list[str]:
    """The dotted names of the wings' ``__init__`` modules that LEVELS does not place: docstrings only."""
    named = {(wing, name) for wing, levels in levels_table() for names in levels for name in names}
    return [f"posbench.{wing}" for wing, _ in levels_table() if wing and (wing, "__init__") not in named]


def levels() -> dict[str, tuple[int, int]]:
    """{dotted module name: (wing, level)}; "*" places every module of its wing that no level names; a wing's
    ``__init__`` that no level names sits below its wing's modules (it imports nothing)."""
    out = {}
    for w, (wing, wing_levels) in enumerate(levels_table()):
        prefix = f"posbench.{wing}." if wing else "posbench."
        named = {n for names in wing_levels for n in names}
        for lv, names in enumerate(wing_levels):
            for n in names:
                if n == "*":
                    for path in sorted((PACKAGE / wing).glob("*.py")):
                        if path.stem not in named and path.stem != "__init__":
                            out[prefix + path.stem] = (w, lv)
                elif n == "__init__":
                    out[f"posbench.{wing}"] = (w, lv)
                else:
                    out[prefix + n] = (w, lv)
        if wing and "__init__" not in named:
            out[f"posbench.{wing}"] = (w, -1)
    return out


def test_every_module_has_one_level():
    """Each module of the package is placed in LEVELS (a new module must say where it stands), once."""
    names = [(wing, n) for wing, wing_levels in levels_table() for ns in wing_levels for n in ns]
    assert len(names) == len(set(names)), "a module is named twice in LEVELS"
    missing = sorted(set(modules()) - {"posbench"} - set(levels()))
    assert not missing, f"modules without a level in posbench.LEVELS: {missing}"
    stale = sorted(set(levels()) - set(modules()))
    assert not stale, f"LEVELS names modules that do not exist: {stale}"
    folders = {path.parts[len(PACKAGE.parts)] for path in PACKAGE.rglob("*.py") if path.parent != PACKAGE}
    assert folders == {wing for wing, _ in levels_table() if wing}, "every folder of the package is a wing of LEVELS"


def test_a_module_imports_only_from_lower_levels():
    """Every import of a package module (top level or inside a function) goes to a lower wing, or to a lower level of
    its own wing: an import from the same level or above fails, naming both modules, their places and the line."""
    mods, level = modules(), levels()
    wrong = []
    for m, path in mods.items():
        if m == "posbench":
            continue
        for target, _, line in imported(m, path, set(mods)):
            if target != "posbench" and level[target] >= level[m]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {m} {level[m]} imports {target} {level[target]}")
    assert not wrong, "imports from the same level or above ((wing, level)):\n" + "\n".join(wrong)


def test_the_level_check_catches_an_upward_import(tmp_path, monkeypatch):
    """The check above fails on a package where a module imports one of a higher wing, of its own level or of a
    higher level of its wing (a fixture package made here), and passes once the imports go down."""
    pkg = tmp_path / "posbench"
    (pkg / "low").mkdir(parents=True)
    (pkg / "high").mkdir()
    (pkg / "low" / "__init__.py").write_text('"""The low wing."""\n')
    (pkg / "high" / "__init__.py").write_text('"""The high wing."""\n')
    (pkg / "__init__.py").write_text('LEVELS: tuple = (("low", (("a",), ("b",))), ("high", (("c",),)))\n')
    (pkg / "high" / "c.py").write_text("from posbench.low import a\n")
    (pkg / "low" / "a.py").write_text("from posbench.high import c\n")
    (pkg / "low" / "b.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    with pytest.raises(AssertionError, match=r"posbench.low.a \(0, 0\) imports posbench.high.c \(1, 0\)"):
        test_a_module_imports_only_from_lower_levels()
    (pkg / "low" / "a.py").write_text("from posbench.low import b\n")
    with pytest.raises(AssertionError, match=r"posbench.low.a \(0, 0\) imports posbench.low.b \(0, 1\)"):
        test_a_module_imports_only_from_lower_levels()  # a higher level of its own wing
    (pkg / "__init__.py").write_text('LEVELS: tuple = (("low", (("a", "b"),)), ("high", (("c",),)))\n')
    with pytest.raises(AssertionError, match=r"posbench.low.a \(0, 0\) imports posbench.low.b \(0, 0\)"):
        test_a_module_imports_only_from_lower_levels()  # the same level is not below
    (pkg / "__init__.py").write_text('LEVELS: tuple = (("low", (("a",), ("b",))), ("high", (("c",),)))\n')
    (pkg / "low" / "a.py").write_text("")
    (pkg / "low" / "b.py").write_text("from posbench.low import a\n")
    test_a_module_imports_only_from_lower_levels()


def test_every_wing_init_is_a_docstring_that_says_what_lives_there():
    """A wing's ``__init__`` that LEVELS does not place holds its docstring and nothing else (importing one module of
    a wing loads that module alone), and the docstring says what the wing may import and where to start reading."""
    for name in wing_inits():
        path = PACKAGE / name.split(".")[1] / "__init__.py"
        tree = ast.parse(path.read_text())
        doc = ast.get_docstring(tree)
        assert doc and len(tree.body) == 1, f"{path}: a docstring and nothing else"
        assert "Import" in doc and "Start with" in " ".join(doc.split()), \
            f"{path}: say what the wing may import and where to start reading"


def test_no_module_imports_back_up():
    """Depth-first search over the import graph (every import, top level or in a function): no cycle."""
    mods = modules()
    graph = {m: {t for t, _, _ in imported(m, p, set(mods))} for m, p in mods.items()}
    state, path = {}, []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                pytest.fail("import cycle: " + " -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t)
        path.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_imports_inside_functions_are_optional_dependencies_with_a_reason():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        tree = ast.parse(path.read_text())
        for f in ast.walk(tree):
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(f):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and node is not f:
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                    ok = all(n.split(".")[0] in LAZY_ALLOWED for n in names) and "#" in lines[node.lineno - 1]
                    if not ok:
                        found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not found, "imports inside functions that are not an optional dependency with a comment:\n" + "\n".join(found)


# One interpreter imports the modules of other packages that posbench's modules import at their top level (torch,
# torch.nn.attention.flex_attention, hydra, …: argv[2], comma-separated), then forks a child per posbench module that
# imports that module alone: posbench's own import order is what is tested, without paying torch's and Dynamo's
# start-up once per module. (A module that used such a module without importing it, where no posbench module it
# imports does, would pass here; ruff's F821 catches a name used without any import.)
FORK_IMPORTS = r"""
import importlib, json, os, sys, traceback
for other in filter(None, sys.argv[2].split(",")):
    importlib.import_module(other)
assert not [m for m in sys.modules if m.split(".")[0] == "posbench"], "posbench imported before the fork"
results, out, names = {}, sys.argv[1], sys.argv[3:]
sys.argv[1:] = []  # (posbench.__main__ runs the command line on import: with no arguments, as ``python -c``)
for name in names:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            __import__(name)
            code, message = 0, ""
        except BaseException:
            code, message = 1, traceback.format_exc()[-3000:]
        os.write(write, message.encode())
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    results[name] = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), message]
with open(out, "w") as file:
    json.dump(results, file)
"""


def third_party_imports() -> set[str]:
    """Modules outside the package that its modules import outside functions (``from X import y``: X), read with
    ``ast``; the lazily imported optional ones (:data:`LAZY_ALLOWED`) are not among them."""
    out = set()
    for path in modules().values():
        tree = ast.parse(path.read_text())
        inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)}
        for node in (n for n in ast.walk(tree) if id(n) not in inside):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level else []
            out |= {n for n in names if n.split(".")[0] not in ("posbench", "__future__", *LAZY_ALLOWED)}
    return out


@pytest.fixture(scope="module")
def imported_alone(tmp_path_factory) -> dict[str, list]:
    """{module: [exit status, traceback]} of importing each module of the package in its own forked child."""
    out = tmp_path_factory.mktemp("imports") / "results.json"
    others = ",".join(sorted(third_party_imports()))
    proc = subprocess.run([sys.executable, "-c", FORK_IMPORTS, str(out), others, *sorted(modules())], capture_output=True,
                          text=True, timeout=300, cwd=PACKAGE.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("module", sorted(modules()))
def test_every_module_imports_alone_in_a_fresh_interpreter(module, imported_alone):
    status, message = imported_alone[module]
    assert status == 0, f"import {module} alone failed:\n{message}"


def test_a_module_that_needs_another_imported_first_fails_alone(tmp_path):
    """The fork check itself: a module that works only after its sibling was imported fails alone."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("import pkg\nVALUE = pkg.b.VALUE\n")  # needs pkg.b, never imports it
    (package / "b.py").write_text("VALUE = 1\n")
    out = tmp_path / "results.json"
    subprocess.run([sys.executable, "-c", FORK_IMPORTS, str(out), "", "pkg.b", "pkg.a"], check=True, cwd=tmp_path, timeout=300)
    results = json.loads(out.read_text())
    assert results["pkg.b"][0] == 0
    assert results["pkg.a"][0] == 1 and "AttributeError" in results["pkg.a"][1]


def test_the_test_sees_every_module():
    """The checks above read the source tree of this checkout: every file of the package is among them."""
    mods = modules()
    assert {"posbench", "posbench.cli", "posbench.schemes", "posbench.schemes.base", "posbench.model.build"} <= set(mods)
    assert len(mods) == len(list(PACKAGE.rglob("*.py")))


def test_no_module_is_over_350_lines_and_a_longer_script_says_why():
    """Every module of the package is at most 350 lines; a script over 350 lines is named in scripts/README.md, whose
    reason for it stands there."""
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 350}
    assert not long, f"modules over 350 lines: {long}"
    scripts = PACKAGE.parent / "scripts"
    readme = (scripts / "README.md").read_text()
    for path in sorted(scripts.iterdir()):
        if path.suffix in (".py", ".sh") and len(path.read_text().splitlines()) > 350:
            assert f"`{path.name}`" in readme.split("two scripts are longer", 1)[-1], f"{path.name}: say why in scripts/README.md"
