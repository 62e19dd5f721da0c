"""A command's stderr less the progress lines a first use may print before its answer (checksums of a
fresh store, a kernel build another process has under way), so a test can hold the rest to one line."""

PROGRESS = ("verifying checksums", "waiting for the build of ", "building ", "built ")


def without_progress(stderr: str) -> list[str]:
    """The non-blank lines of `stderr` that are not progress lines."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith(PROGRESS)]
