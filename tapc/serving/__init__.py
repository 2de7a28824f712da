"""Taps over vLLM's OpenAI-compatible server (`vllm serve`), through vLLM's endpoint-plugin group.

- `launch.py`: `tapc serve`: the plan, then `vllm serve` with the engine arguments the plan
  needs and tapc's endpoint plugin allowed (`VLLM_PLUGINS`).
- `asks.py`: a request's taps as JSON text in `vllm_xargs["tapc"]`, into a `TapRequest`.
- `server.py`: the server's side of each request (check, salt, wire, collect, results).
- `http.py`: the endpoint plugin: tapc's routes and the middleware on vLLM's completion routes.
- `results.py`: where a request's results wait for their fetch; `saving.py`: a server's harvest
  folder, for requests that ask `"save": true`.
- `client.py`: taps over a `tapc serve` server for users of the `openai` client.
docs/serving.md says how to use it.
"""
