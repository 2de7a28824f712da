"""The caller's side: `VLLM` (`llm`) and `AsyncVLLM` (`async_llm`) over the session (`session`:
each request's way in and out; `gather`: the replies of every GPU and engine, one result a
request), one engine's plan, config, vLLM arguments and session, for
`tapc serve` too (`engine`), vLLM's arguments and their checks (`engine_args`), the prefix-cache
policy (`prefix`), what one request asks for (`requests`, `TapRequest`) and specs turned into
plans (`specs`). Never imports the worker."""
