"""What crosses between the API process and vLLM's workers: typed messages and their wire form
(`protocol`), which positions a request covers (`positions`), the shared-memory arena captures
come back through (`arena`), which shared memory a process sees (`node`) and what an engine is
started with (`config`). Imports nothing of tapc but its errors and settings, so either side
may import it."""
