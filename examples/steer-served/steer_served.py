"""Steering a served model over HTTP: `tapc serve`, a steering vector registered by name, and the
same prompts asked steered and unsteered.

The script writes a small Llama, starts `tapc serve` on it with one steering tap (layer 2's
residual stream, `add(steer, alpha=alpha)`: each request that binds `steer` and `alpha` is
steered, the others are not) and a capture of that layer after it, then asks each prompt twice
with `TapcClient`: once plain, once with the registered vector. Printed: both completions, and
how far the steered request's captured rows are from the plain ones plus alpha times the vector
(the edit, read back).

    python examples/steer-served/steer_served.py
"""
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # examples/, for small_models
from small_models import SMALL, engine_args, require_gpu, small_model, verdict  # noqa: E402

LAYER, ALPHA = 2, 4.0
KEY = f"model.layers.{LAYER}.resid"
TAPS = [f"{KEY} | add(steer, alpha=alpha)",   # edits first: the capture below sees the steered rows
        KEY]
NAME = "small"   # the model's name on the server
PROMPTS = ["The king and the queen lived in a house by the river",
           "When Mary and John went to the store, John gave a drink to",
           "One morning the children walked to the park with their teacher"]
TOLERANCE = 0.02   # bf16 rows of two runs


def server_command(model: str, port: int) -> list[str]:
    """`tapc serve` with the taps; the rest are `vllm serve` options (tapc takes the batch sizes
    into its plan)."""
    options = [f"--{key.replace('_', '-')}={value}" for key, value in engine_args().items()]
    taps = [arg for tap in TAPS for arg in ("--tap", tap)]
    return [sys.executable, "-m", "tapc.cli", "serve", model, *taps, "--served-model-name", NAME,
            "--host", "127.0.0.1", "--port", str(port), *options]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(server: subprocess.Popen, port: int, log: Path, timeout: float = 300.0) -> None:
    """Until the server answers /health; its log's tail if it exits or takes longer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"tapc serve exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise SystemExit(f"tapc serve did not answer within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def main() -> int:
    require_gpu()
    import torch

    from tapc.serving.client import TapcClient

    model = small_model("llama")
    port, log = free_port(), Path(tempfile.mkdtemp(prefix="tapc-serve-")) / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(server_command(model, port), stdout=out, stderr=subprocess.STDOUT, env=os.environ)
    try:
        wait_ready(server, port, log)
        tc = TapcClient(f"http://127.0.0.1:{port}/v1")
        vector = torch.randn(SMALL["hidden_size"], generator=torch.Generator().manual_seed(0))
        vector /= vector.norm()
        tc.register("away", vector)
        plain_ask = tc.ask(capture=[KEY], positions="prompt")
        steer_ask = tc.ask(capture=[KEY], positions="prompt", params={"steer": "away", "alpha": ALPHA})
        wrong = []
        for i, prompt in enumerate(PROMPTS):
            texts, rows = [], []
            for ask in (plain_ask, steer_ask):
                resp, tid = tc.complete(model=NAME, prompt=prompt, max_tokens=12, temperature=0.0,
                                        extra_body={"ignore_eos": True}, taps=ask)
                texts.append(resp.choices[0].text)
                rows.append(tc.results(tid)[KEY].float())
            edit = ALPHA * vector
            error = float((rows[1] - rows[0] - edit).norm(dim=-1).max() / edit.norm())
            print(f"prompt {i}: {prompt!r}")
            print(f"  plain:   {texts[0]!r}")
            print(f"  steered: {texts[1]!r}")
            print(f"  steered rows - plain rows against {ALPHA} x the vector: {error:.4f} apart (relative)")
            if texts[0] == texts[1]:
                wrong.append(f"prompt {i}: the steered completion is the plain one")
            if error > TOLERANCE:
                wrong.append(f"prompt {i}: the captured edit is {error:.4f} from alpha x the vector")
    finally:
        server.terminate()   # SIGTERM: vLLM shuts its engine down
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    return verdict(wrong, "every steered completion differs from the plain one, and its rows differ by alpha x "
                          "the vector")


if __name__ == "__main__":
    sys.exit(main())
