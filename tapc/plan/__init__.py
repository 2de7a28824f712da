"""Tap plans: a model's folder and config checks (`modeldir`), vLLM's module tree as a value,
loaded and cached (`tree`), built on the meta device (`metamodel`), its forwards' calls read
from source (`forwards`, which the worker imports too), taps resolved against it (`resolve`),
`call` taps against their functions (`calls`), `lens` taps made captures (`lens`), attention patterns' rows sized
(`pattern`), the plan built (`planner`) as a value
(`tapplan`), its device memory (`sizing`), each point's and each GPU's part under tensor / pipeline
parallelism (`sharding`, `ranks`, held as `shards`), and the plan for people (`explain`). Runs on any machine: no GPU, no engine."""
