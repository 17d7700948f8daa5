"""The house's one rule about files: a script (a file with `if __name__ == "__main__"`) is run, never imported by
other code but the tests; what two scripts share lives in a library module."""
import ast
import glob
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def imported_modules(path: str) -> set[str]:
    """Top-level names of every module a file imports, wherever the import statement stands."""
    names = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_no_file_imports_a_script():
    files = sorted(glob.glob(os.path.join(REPO, "*.py")))
    scripts = {os.path.basename(p)[:-3] for p in files if "__main__" in open(p, encoding="utf-8").read()}
    assert {"train_pretrain", "sample", "serve", "bench", "prepare_demo"} <= scripts  # the rule reads them right
    for path in files:
        assert not imported_modules(path) & scripts, f"{os.path.basename(path)} imports a script"


def python_files() -> list[str]:
    return sorted(p for pattern in ("*.py", "*/*.py", "*/*/*.py") for p in glob.glob(os.path.join(REPO, pattern))
                  if not os.path.relpath(p, REPO).startswith(("out", "data")))


def test_every_file_is_short_and_every_function_under_60_lines_but_a_scripts_main():
    for path in python_files():
        source = open(path, encoding="utf-8").read()
        name = os.path.relpath(path, REPO)
        assert len(source.splitlines()) <= 600, f"{name}: {len(source.splitlines())} lines"
        script = "__main__" in source and not name.startswith("tests")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not (script and node.name == "main"):
                assert node.end_lineno - node.lineno < 60, f"{name}:{node.lineno} {node.name} is over 60 lines"


def test_only_fileio_replaces_a_file():
    """One way to replace a file: fileio's temp file, fsync, rename."""
    for path in python_files():
        name = os.path.relpath(path, REPO)
        if name != "fileio.py" and not name.startswith("tests"):
            source = open(path, encoding="utf-8").read()
            assert "os.replace(" not in source and "os.rename(" not in source, f"{name} renames a file itself"


def test_readme_lists_every_top_level_file():
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    for path in glob.glob(os.path.join(REPO, "*.py")):
        assert f"`{os.path.basename(path)}`" in readme, f"README's Files table lacks {os.path.basename(path)}"
    assert "`tasks/`" in readme and "`vocab/`" in readme
