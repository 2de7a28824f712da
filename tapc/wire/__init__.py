"""What crosses between the API process and vLLM's workers: typed messages and their wire form
(`protocol`), which positions a request covers (`positions`), the shared-memory arena captures
come back through (`arena`), which shared memory a process sees (`node`) and the engine
arguments a plan needs (`engine_args`). Imports nothing of tapc but its errors, so either side
may import it."""
