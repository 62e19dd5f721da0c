"""A model split by layers across processes or machines over the framework's own distributed engine
(pipeline.py: the protocol; stages.py: which layers each rank runs; transport.py: the wire;
launch.py: joining from a process mlx.launch or torchrun started; batch.py: the throughput mode's
micro-batches through the ranks; conversations.py: the chat's and the server's conversations across
ranks; serving.py: the server's engine thread across ranks). The commands' --pipeline flags are
cli/pipeline_flags.py: parsed without importing this package."""
