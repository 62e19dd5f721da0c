"""Human-readable sizes for messages, shared by the dense and the MoE budget planners."""


def fmt(n: int) -> str:
    """Bytes as megabytes with one decimal (decimal units: 300000000 -> "300.0 MB")."""
    return f"{n / 1e6:.1f} MB"


def fmt_apart(a: int, b: int) -> tuple[str, str]:
    """a and b as fmt() writes them, with more decimals when one decimal would show two different
    amounts as the same ("60.0 MB is below the minimum 60.0 MB"), and as bytes when even six do."""
    for digits in (1, 3, 6):
        x, y = f"{a / 1e6:.{digits}f} MB", f"{b / 1e6:.{digits}f} MB"
        if x != y or a == b:
            return x, y
    return f"{a} bytes", f"{b} bytes"
