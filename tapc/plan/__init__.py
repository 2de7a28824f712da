"""Tap plans: vLLM's module tree on the meta device (`tree`), taps resolved against it
(`resolve`), `call` taps against their functions (`calls`), the plan built (`planner`) as a value
(`tapplan`), its device memory (`sizing`), each point's and each GPU's part under tensor / pipeline
parallelism (`sharding`, `ranks`, held as `shards`), and the plan for people (`explain`). Runs on any machine: no GPU, no engine."""
