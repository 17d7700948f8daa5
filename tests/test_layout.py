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
