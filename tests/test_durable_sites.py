"""Every persistent write of the package goes through mlx_flash/durable.py (docs/durability.md).

The package's source is read with ast (nothing imported) for calls that write a file or rename one:
open() with a write mode, os.open with a write flag, os.write/pwrite/truncate/fallocate, os.replace
and os.rename, shutil copies and moves, numpy's tofile/save, json.dump, library savers
(save_safetensors, save_pretrained), Path.write_text/write_bytes. Any such call outside durable.py
must be in ALLOWED below, with the reason its file need not survive a crash; an entry no call uses
any more fails too, so the list stays short and true.
"""

from __future__ import annotations

import ast
import os

import pytest

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mlx_flash")
HELPER = "durable.py"

# (file, or folder ending in "/", relative to mlx_flash/; the call as the scanner names it; why)
ALLOWED = (
    ("store/atomic_dir.py", "os.open", "the output lock: holds no data, only the holder's pid for a message"),
    ("store/atomic_dir.py", "os.pwrite", "the output lock's pid (see os.open above)"),
    ("store/atomic_dir.py", "os.ftruncate", "(the output lock above)"),
    ("locate/download.py", "open", "the download's lock file: holds no data"),
    ("store/in_use.py", "open", "in-use lock files: hold no data (their mtime is a hint of last use)"),
    ("store/positional_io.py", "os.pwrite", "the positional writer of the unlinked KV tier and spill files"),
    ("store/kv_tier_file.py", "os.posix_fallocate", "a file unlinked once made: nothing of it is read after a crash"),
    ("offload/kv_spill.py", "os.open", "a run's KV spill files: private to the run, removed when it ends"),
    ("offload/kv_spill.py", "os.ftruncate", "(the spill files above)"),
    ("offload/kv_spill.py", "open", "the spill folder's lock file: holds no data"),
    ("offload/kv_spill.py", "os.rename", "the spill folder's lock shown once held; the folder dies with the run"),
    ("distributed/local.py", "open", "the host file of one local launch, read by its ranks as they start"),
    ("distributed/local.py", "json.dump", "(the host file above)"),
    ("bench/commands/pipeline.py", "open", "the prompts of one run, in its TemporaryDirectory"),
    ("bench/results.py", "open", "docs/results pages in the source tree: git holds them"),
    ("bench/cgroup.py", "open", "cgroup control files of the kernel, not data"),
    ("bench/commands/flash.py", "open", "cgroup control files of the kernel, not data"),
    ("bench/service_trace.py", "open", "/proc/sys/vm/drop_caches: a kernel control, not data"),
    ("bench/load_client.py", "open", "a benchmark server's log, for a person"),
    ("bench/memory_child.py", "open", "a child's report to its parent within one run"),
    ("bench/memory_child.py", "json.dump", "(the report above)"),
    ("moe/routing.py", "np.savez_compressed", "into memory: durable.write_durably writes the bytes"),
    ("bench/switching_trace.py", "shutil.copytree", "a replay's scratch copy of the build, removed after"),
    ("convert/gguf_tokenizer.py", "save_pretrained", "transformers' files in a folder written whole (sync_tree)"),
    ("convert/mlx_lm_dir.py", "save_safetensors", "mlx's file in a folder written whole (replace_folder)"),
    ("calibrate/derive_moe.py", "save_safetensors", "mlx's file in a folder written whole (atomic_dir)"),
)

WRITE_FLAGS = {"O_CREAT", "O_WRONLY", "O_RDWR", "O_APPEND", "O_TRUNC"}
OS_WRITES = {"write", "pwrite", "pwritev", "writev", "truncate", "ftruncate", "posix_fallocate", "replace", "rename"}
OS_WRITES |= {"renames"}
SHUTIL_WRITES = {"copy", "copy2", "copyfile", "copytree", "move", "copyfileobj"}
NUMPY_WRITES = {"save", "savez", "savez_compressed", "savetxt"}
SAVERS = {"tofile", "save_safetensors", "save_pretrained", "write_text", "write_bytes"}


def _name(node: ast.AST) -> str:
    """`a.b.c` of a call's function (its last part alone when it is not a plain dotted name)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _name(node.value)
        return f"{inner}.{node.attr}" if inner else node.attr
    return ""


def _writes_by_mode(mode: ast.AST | None) -> bool:
    """An open() mode that writes; a mode not written out (an expression) counts as one."""
    if mode is None:
        return False
    if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
        return any(c in mode.value for c in "wax+")
    return True


def _arg(call: ast.Call, index: int, keyword: str) -> ast.AST | None:
    for kw in call.keywords:
        if kw.arg == keyword:
            return kw.value
    return call.args[index] if len(call.args) > index else None


def write_call(call: ast.Call) -> str | None:
    """The name of the write `call` makes (as ALLOWED names it), or None when it writes nothing."""
    name = _name(call.func)
    last = name.rsplit(".", 1)[-1]
    if (name == "open" and isinstance(call.func, ast.Name)) or name in ("io.open", "os.fdopen"):
        return "open" if _writes_by_mode(_arg(call, 1, "mode")) else None
    if isinstance(call.func, ast.Attribute) and last == "open" and name not in ("os.open", "io.open"):
        # Path(...).open("w"); other objects' open(path) (a reader pool's) take no mode
        mode = _arg(call, 0, "mode")
        literal = isinstance(mode, ast.Constant) and isinstance(mode.value, str)
        return "open" if literal and _writes_by_mode(mode) else None
    if name == "os.open":
        flags = _arg(call, 1, "flags")
        used = {n.attr for n in ast.walk(flags) if isinstance(n, ast.Attribute)} if flags is not None else set()
        return "os.open" if used & WRITE_FLAGS or not isinstance(flags, (ast.Attribute, ast.BinOp)) else None
    if name.startswith("os.") and last in OS_WRITES and name.count(".") == 1:
        return name
    if name.startswith("shutil.") and last in SHUTIL_WRITES:
        return name
    if name.split(".")[0] in ("np", "numpy") and last in NUMPY_WRITES:
        return f"np.{last}"
    if name in ("json.dump",):
        return name
    if isinstance(call.func, ast.Attribute) and last in SAVERS:
        return last
    return None


def scan(source: str) -> list[tuple[int, str]]:
    """(line, call) of every write call in `source`."""
    return [
        (node.lineno, found)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and (found := write_call(node))
    ]


def allowed(rel: str, call: str) -> tuple | None:
    for entry in ALLOWED:
        where, what, _why = entry
        if what == call and (rel == where or (where.endswith("/") and rel.startswith(where))):
            return entry
    return None


def package_writes() -> list[tuple[str, int, str]]:
    found = []
    for folder, _dirs, files in os.walk(PACKAGE_DIR):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, PACKAGE_DIR).replace(os.sep, "/")
                if rel != HELPER:
                    with open(path, encoding="utf-8") as fh:
                        found += [(rel, line, call) for line, call in scan(fh.read())]
    return found


def test_every_persistent_write_goes_through_durable_py():
    stray = [f"mlx_flash/{rel}:{line}: {call}" for rel, line, call in package_writes() if not allowed(rel, call)]
    assert not stray, (
        "writes outside mlx_flash/durable.py (use its DurableFile / write_durably / FolderFile ..., or add the "
        "site to ALLOWED with the reason its file need not survive a crash):\n" + "\n".join(stray)
    )


def test_every_allowed_entry_is_used_and_says_why():
    used = {allowed(rel, call) for rel, _line, call in package_writes()}
    for entry in ALLOWED:
        assert entry[2].strip(), f"{entry[:2]}: no reason given"
        assert entry in used, f"{entry[:2]}: no such write any more; remove it from ALLOWED"


@pytest.mark.parametrize(
    "planted, call",
    [
        ('open(p, "w").write("x")', "open"),
        ('with open(p, mode="ab") as f: pass', "open"),
        ('open(p, "wb" if fresh else "ab")', "open"),
        ('pathlib.Path(p).open("w")', "open"),
        ("os.replace(a, b)", "os.replace"),
        ("os.rename(a, b)", "os.rename"),
        ("fd = os.open(p, os.O_WRONLY | os.O_CREAT)", "os.open"),
        ("os.write(fd, b)", "os.write"),
        ("arr.tofile(p)", "tofile"),
        ("np.save(p, arr)", "np.save"),
        ("numpy.savez_compressed(p, a=arr)", "np.savez_compressed"),
        ("json.dump(obj, fh)", "json.dump"),
        ("shutil.move(a, b)", "shutil.move"),
        ("shutil.copy2(a, b)", "shutil.copy2"),
        ("Path(p).write_text(s)", "write_text"),
        ("mx.save_safetensors(p, tensors)", "save_safetensors"),
    ],
)
def test_the_scanner_finds_a_planted_write(planted, call):
    source = f"import os\n\n\ndef f(p, a, b, fd, arr, obj, fh, s, fresh):\n    {planted}\n"
    assert scan(source) == [(5, call)]
    assert not allowed("sparse/new_module.py", call)  # a new file is allowed nothing


@pytest.mark.parametrize(
    "harmless",
    [
        "open(p).read()",
        'open(p, "rb").read()',
        'open(p, mode="r", encoding="utf-8")',
        "os.open(p, os.O_RDONLY)",
        "os.open(p, os.O_RDONLY | os.O_DIRECT)",
        "json.dumps(obj)",
        "tok.save_vocab",
        "os.path.join(a, b)",
    ],
)
def test_the_scanner_leaves_reads_alone(harmless):
    assert scan(f"import os\n{harmless}\n") == []
