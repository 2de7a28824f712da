"""Where the tests find the checkout, their helpers, the test models' configs and the examples' scripts."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = Path(__file__).resolve().parent   # this folder: the helpers, on sys.path (conftest.py)
CONFIGS = SUPPORT / "configs"   # vLLM configs of small models, one folder each
EXAMPLES = ROOT / "examples"
SCRIPTS = {"sae": "sae/sae.py", "steer-served": "steer-served/steer_served.py", "probe": "probe/probe.py",
           "patching": "patching/patching.py", "moe-routing": "moe-routing/moe_routing.py", "lora": "lora/lora.py",
           "lens": "lens/lens.py", "induction": "induction/induction.py"}
