"""tests.support.zygote: which workers it forks, and that a forked rank is what torchrun would have started."""
import json
import os
import time

import pytest

from tests.support import zygote
from tests.support.dist import run_torchrun

WORKER = '''\
"""A rank: joins the group, reduces, writes what a fresh torchrun rank would show."""
import json
import os

import tests.support.megatron_cpu_shim  # noqa: F401

import random  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
if os.environ.get("FAIL_RANK") == str(rank):
    sys.exit(3)
if os.environ.get("FAIL_RANK"):
    dist.barrier()  # never completes: the failed rank is gone
with open(os.path.join(os.environ["OUT_DIR"], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": dist.get_world_size(), "local_rank": int(os.environ["LOCAL_RANK"]),
               "total": total.item(), "ppid": os.getppid(), "random": random.random(), "argv": sys.argv[1:],
               "torch_seed": torch.initial_seed(),
               "main": __name__, "path0": sys.path[0]}, f)
print(f"rank {rank} done")
'''


def test_preload_is_the_first_import_after_the_standard_library(tmp_path):
    cases = {
        '"""doc"""\nimport json\nfrom os import path\nfrom tests.support import nemo_cpu\nimport torch\n':
            "tests.support.nemo_cpu",
        "from __future__ import annotations\nimport tests.support.megatron_cpu_shim\n":
            "tests.support.megatron_cpu_shim",
        "import os\nos.environ.setdefault('SHIM_LEVEL', '4')\nimport tests.support.megatron_cpu_shim\n": None,
        "import torch\nfrom tests.support import nemo_cpu\n": None,
        "import json\n": None,
    }
    for i, (text, want) in enumerate(cases.items()):
        script = tmp_path / f"w{i}.py"
        script.write_text(text)
        assert zygote.preload_of(script) == want, text


def test_forked_ranks_are_torchrun_ranks(tmp_path):
    script = tmp_path / "rank_worker.py"
    script.write_text(WORKER)
    runs = []
    for i in range(2):
        out = tmp_path / f"out{i}"
        out.mkdir()
        proc = run_torchrun(script, "--flag", "x y", nproc=2, out_dir=out)
        runs.append([json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)])
        assert "rank 0 done" in proc.stdout and "rank 1 done" in proc.stdout
    z = zygote._ZYGOTES[("tests.support.megatron_cpu_shim", os.environ.get("SHIM_LEVEL", ""))]
    for ranks in runs:
        assert [r["rank"] for r in ranks] == [0, 1] and [r["local_rank"] for r in ranks] == [0, 1]
        assert all(r["world"] == 2 and r["total"] == 3.0 and r["argv"] == ["--flag", "x y"] for r in ranks)
        assert all(r["ppid"] == z.proc.pid for r in ranks)  # forked by the one zygote, twice
        assert all(r["main"] == "__main__" and r["path0"] == str(tmp_path) for r in ranks)
        # re-seeded from the OS like separate interpreters (torch too: it seeds each process at random)
        assert ranks[0]["random"] != ranks[1]["random"] and ranks[0]["torch_seed"] != ranks[1]["torch_seed"]
    assert runs[0][0]["random"] != runs[1][0]["random"] and runs[0][0]["torch_seed"] != runs[1][0]["torch_seed"]


def test_a_failed_rank_stops_the_others_and_names_its_output(tmp_path):
    script = tmp_path / "rank_worker.py"
    script.write_text(WORKER)
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"forked from the tests.support.megatron_cpu_shim zygote\) failed "
                                             r"\(rc=3\)"):
        run_torchrun(script, nproc=2, out_dir=tmp_path, env={"FAIL_RANK": "1"}, timeout=120)
    assert time.monotonic() - start < 60  # rank 0, stuck in a barrier, was stopped after the grace
    assert not list(tmp_path.glob("rank*.json"))


def test_the_switch_sends_launches_to_torchrun(tmp_path, monkeypatch):
    monkeypatch.setenv("NEMO_DAPO_TEST_ZYGOTE", "0")
    script = tmp_path / "rank_worker.py"
    script.write_text(WORKER)
    run_torchrun(script, nproc=2, out_dir=tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["total"] == 3.0 for r in ranks)
    assert all(r["ppid"] not in {z.proc.pid for z in zygote._ZYGOTES.values()} for r in ranks)
