"""Whether a worker shares the API's shared memory (tapc/wire/node.py): it then answers a
collect with places in its capture files, else with the rows themselves."""
import subprocess
import sys

from engine_toy import toy_plan

from tapc import settings
from tapc.api.engine_args import engine_kwargs
from tapc.wire.node import shm_identity
from tapc.worker.worker import _on_api_node


def test_another_process_of_this_host_sees_the_same_shared_memory():
    other = subprocess.run([sys.executable, "-c", "from tapc.wire.node import shm_identity; print(shm_identity())"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert other == shm_identity() and other.count(":") == 2


def test_another_folder_or_none_is_not_the_same(tmp_path, monkeypatch):
    assert shm_identity(str(tmp_path)) != shm_identity()
    assert shm_identity(str(tmp_path / "missing")) is None
    monkeypatch.setattr(settings, "TAPC_SHM_DIR", str(tmp_path / "missing"))
    assert _on_api_node(f"{shm_identity(str(tmp_path))}") is False   # cannot read its own: rows are sent


def test_the_engine_config_carries_the_apis_identity_and_the_worker_compares_it():
    api = engine_kwargs(toy_plan(["model.layers.1.resid"]), {})[1].api_shm
    assert api == shm_identity()
    assert _on_api_node(api) is True
    boot, dev, ino = api.split(":")
    assert _on_api_node(f"{boot}:{dev}:{int(ino) + 1}") is False   # another folder: another container's /dev/shm
    assert _on_api_node(f"another-boot:{dev}:{ino}") is False       # another node
