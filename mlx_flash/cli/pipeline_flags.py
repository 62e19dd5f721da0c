"""The flags of a command that can run as a pipeline across ranks (chat, batch): parsed before anything
heavy is imported."""

from __future__ import annotations


def add_pipeline_arguments(p, answers: str) -> None:
    """--pipeline and --pipeline-timeout, for a command whose rank 0 `answers` (chat, batch)."""
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="run the model split by layers across the ranks mlx.launch (MLX's ring) or torchrun "
        f'(gloo) started: rank 0 {answers}, the others run their layers (README "Pipeline across '
        'machines")',
    )
    p.add_argument(
        "--pipeline-timeout",
        type=float,
        default=30.0,
        help="with --pipeline: seconds rank 0 waits for one step round the ranks before it names them "
        "and exits; make it longer than the slowest step, a prefill chunk (default: 30)",
    )
