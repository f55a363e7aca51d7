"""tepokit/__init__.py: the folders of tepokit/ and the rule of their imports. Every import of the project's code
(module level or inside a function) is read from the source: a folder imports only the folders listed below it in
tepokit/__init__.py, no module takes part in an import circle, and nothing imports train_small.py."""
import ast
import os
import re

from tepokit.tests.helpers import REPO

ORDER = ["tools", "cli", "diagnostics", "setup", "core", "plumbing"]     # top to bottom, as listed


def project_modules() -> dict:
    """{module name: path} of every .py file of the project but the tests."""
    found = {"tepo": "tepo.py", "train_small": "train_small.py"}
    for folder, _, files in os.walk(os.path.join(REPO, "tepokit")):
        if "tests" in folder.split(os.sep):
            continue
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), REPO)
                found[rel[:-3].replace(os.sep, ".").removesuffix(".__init__")] = rel
    return found


def imports_of(path: str, modules: dict) -> set:
    """The project modules `path` imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(open(os.path.join(REPO, path)).read())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n in modules}
    return out


def test_the_folders_are_the_ones_tepokit_init_lists_and_imports_only_go_down():
    modules = project_modules()
    listed = re.findall(r"^  (\w+)/ ", open(os.path.join(REPO, "tepokit", "__init__.py")).read(), re.M)
    assert listed == ORDER
    folders = {m.split(".")[1] for m in modules if m.count(".") >= 1}
    assert folders == set(ORDER), folders
    rank = {folder: i for i, folder in enumerate(ORDER)}
    upward = []
    for module, path in modules.items():
        if module.count(".") < 2:
            continue
        for target in imports_of(path, modules):
            if target.count(".") >= 1 and target.split(".")[1] in rank:
                if rank[target.split(".")[1]] < rank[module.split(".")[1]]:
                    upward.append((module, target))
    assert upward == []


def test_no_module_is_part_of_an_import_circle_and_nothing_imports_train_small():
    modules = project_modules()
    graph = {m: {t for t in imports_of(p, modules) if t != m and t != "tepokit"} for m, p in modules.items()}
    assert not [m for m, targets in graph.items() if "train_small" in targets]

    def reaches(start, goal, seen):
        for t in graph[start]:
            if t == goal or (t not in seen and not seen.add(t) and reaches(t, goal, seen)):
                return True
        return False
    assert [m for m in graph if reaches(m, m, set())] == []


def test_modules_stay_short():
    """Every module at most 500 lines, tepo.py at most 1,500, train_small.py at most 700."""
    limits = {"tepo.py": 1500, "train_small.py": 700}
    for module, path in project_modules().items():
        lines = open(os.path.join(REPO, path)).read().split("\n")
        assert len(lines) - 1 <= limits.get(path, 500), (path, len(lines) - 1)


def test_no_line_of_python_is_over_120_characters():
    """Every .py file of the repository, the tests, the notebooks' helpers and the experiments' scripts included
    (left out: runs, hidden directories and virtual environments, such as a venv/ made inside the repository)."""
    long = []
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__")) and d != "runs"
                   and not os.path.exists(os.path.join(folder, d, "pyvenv.cfg"))]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                long += [f"{os.path.relpath(path, REPO)}:{i}" for i, line in enumerate(open(path), 1)
                         if len(line.rstrip("\n")) > 120]
    assert not long
