"""The caller's side: `VLLM` (`llm`) and `AsyncVLLM` (`async_llm`) over the session (`session`:
each request's way in and out), the prefix-cache policy (`prefix`), what one request asks for
(`requests`, `TapRequest`) and specs turned into plans (`specs`). Never imports the worker."""
