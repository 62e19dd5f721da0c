"""The package's requirements, one a line, read from pyproject.toml without installing anything:
`make chat` installs the build's requirements into the venv, then builds the package there without
isolation (pip would otherwise install them again into a temporary environment, on the path of a
fresh install's first answer) beside an install of its run-time dependencies.

    python tools/dependencies.py [--build] [PYPROJECT]

Without --build: `[project] dependencies`. With it: `[build-system] requires`, less cmake where the
cmake on PATH is recent enough (setup.py then runs that one; PyPI's is a 30 MB download).

Python 3.11 reads the file with tomllib; 3.10 (which the package supports and has no tomllib) with
a reading of the one array this needs, `dependencies = [ ... ]` or `requires = [ ... ]`, of strings
and comments.
"""

import ast
import re
import shutil
import subprocess
import sys
from typing import NamedTuple


class Array(NamedTuple):
    """One array of pyproject.toml: its table, its key, and the plain reading's pattern (the array
    ends with the first "]" that closes a line)."""

    table: str
    key: str
    pattern: str


RUNTIME = Array("project", "dependencies", r"^dependencies = (\[.*?\])\s*$")
BUILD = Array("build-system", "requires", r"^requires = (\[.*?\])\s*$")


def requirements(text: str, which: Array = RUNTIME) -> list[str]:
    table, key, pattern = which
    try:
        import tomllib  # deferred: absent before Python 3.11, where the plain reading below serves
    except ImportError:
        m = re.search(pattern, re.sub(r"#[^\n]*", "", text), re.S | re.M)
        if m is None:
            raise ValueError(f"no `{key} = [...]` array") from None
        return list(ast.literal_eval(m.group(1)))
    return list(tomllib.loads(text)[table][key])


def cmake_on_path() -> tuple[int, ...] | None:
    """The version of the cmake on PATH, None where there is none or it does not say."""
    if shutil.which("cmake") is None:
        return None
    try:
        out = subprocess.run(["cmake", "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.match(r"cmake version (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def without_present_cmake(reqs: list[str], present: tuple[int, ...] | None) -> list[str]:
    """`reqs` less a `cmake>=X.Y` that the cmake on PATH (version `present`) meets."""

    def met(req: str) -> bool:
        m = re.fullmatch(r"cmake\s*>=\s*(\d+)\.(\d+)", req.strip())
        return m is not None and present is not None and present >= (int(m.group(1)), int(m.group(2)))

    return [r for r in reqs if not met(r)]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    build = "--build" in argv
    rest = [a for a in argv if a != "--build"]
    path = rest[0] if rest else "pyproject.toml"
    try:
        with open(path) as f:
            text = f.read()
        reqs = requirements(text, BUILD if build else RUNTIME)
    except (OSError, ValueError, KeyError, SyntaxError) as e:
        what = "build requirements" if build else "dependencies"
        print(f"error: {path}: cannot read the {what} ({e})", file=sys.stderr)
        return 2
    print(*(without_present_cmake(reqs, cmake_on_path()) if build else reqs), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
