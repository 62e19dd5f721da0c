"""The package's run-time dependencies, one requirement a line, read from pyproject.toml without
installing anything: `make chat` installs them beside the build of the package itself.

    python tools/dependencies.py [PYPROJECT]

Python 3.11 reads the file with tomllib; 3.10 (which the package supports and has no tomllib) with
a reading of the one array this needs, `dependencies = [ ... ]` of strings and comments.
"""

import ast
import re
import sys


def dependencies(text: str) -> list[str]:
    try:
        import tomllib  # deferred: absent before Python 3.11, where the plain reading below serves
    except ImportError:
        m = re.search(r"^dependencies = (\[.*?^\])", text, re.S | re.M)
        if m is None:
            raise ValueError("no `dependencies = [...]` array") from None
        return list(ast.literal_eval(re.sub(r"#[^\n]*", "", m.group(1))))
    return list(tomllib.loads(text)["project"]["dependencies"])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else "pyproject.toml"
    try:
        with open(path) as f:
            print(*dependencies(f.read()), sep="\n")
    except (OSError, ValueError, KeyError, SyntaxError) as e:
        print(f"error: {path}: cannot read the dependencies ({e})", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
