"""Human-readable sizes for messages, shared by the dense and the MoE budget planners."""


def fmt(n: int) -> str:
    """Bytes as megabytes with one decimal (decimal units: 300000000 -> "300.0 MB")."""
    return f"{n / 1e6:.1f} MB"
