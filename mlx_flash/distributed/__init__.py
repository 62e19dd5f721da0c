"""A model split by layers across processes or machines over the framework's own distributed engine
(pipeline.py: the protocol; stages.py: which layers each rank runs; transport.py: the wire;
launch.py: joining from a process mlx.launch started)."""
