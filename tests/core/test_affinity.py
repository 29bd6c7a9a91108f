"""CPU affinity (core/affinity.py): the lists a trainer or an engine server may be pinned to, and the pinning."""
import os
import subprocess
import sys

import pytest

from nemo_dapo.core.affinity import cpu_set_problem, parse_cpu_list, pin_cpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cpu_lists_in_tasksets_notation():
    assert parse_cpu_list("0") == [0] and parse_cpu_list("0,2-4") == [0, 2, 3, 4]
    for bad in ("", "a", "1-", "-1", "0,,1"):
        with pytest.raises(ValueError, match="expected CPU ids such as 0,2-3"):
            parse_cpu_list(bad)


def test_only_cpu_lists_of_this_machine_are_accepted():
    mine = sorted(os.sched_getaffinity(0))
    assert cpu_set_problem(mine[:1]) is None and cpu_set_problem(mine) is None
    assert "CPUs [4096] that this machine does not have" in cpu_set_problem([mine[0], 4096])
    for bad in ([], "0", [True], [0.5], None):
        assert "must be a non-empty list of CPU ids" in cpu_set_problem(bad)


def _in_child(code: str) -> list:
    out = subprocess.run([sys.executable, "-c", "import os, subprocess, sys\n"
                          "from nemo_dapo.core.affinity import pin_cpus\n" + code],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_pinning_binds_the_process_and_what_it_starts_later():
    cpu = min(os.sched_getaffinity(0))
    got = _in_child(f"pin_cpus([{cpu}])\n"
                    "child = subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'],"
                    " capture_output=True, text=True).stdout.strip()\n"
                    "print(sorted(os.sched_getaffinity(0)), child)")
    assert got == [f"[{cpu}]", f"[{cpu}]"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_process_started_by_a_pinned_one_may_pin_itself_elsewhere():
    # the trainer pins itself (trainer.cpus) before it starts its engine server (rollout.server.cpus)
    a, b = sorted(os.sched_getaffinity(0))[:2]
    got = _in_child(f"pin_cpus([{a}])\n"
                    f"code = 'import os; from nemo_dapo.core.affinity import pin_cpus; pin_cpus([{b}]); "
                    "print(sorted(os.sched_getaffinity(0)))'\n"
                    "print(subprocess.run([sys.executable, '-c', code], capture_output=True, text=True).stdout.strip())")
    assert got == [f"[{b}]"]


def test_a_refused_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match="must be a non-empty list"):
        pin_cpus([])
    with pytest.raises(ValueError, match=r"CPUs \[4096\] that this machine does not have"):
        pin_cpus([4096])


def test_the_cpu_config_names_a_bad_cpu_list():
    from nemo_dapo.local.config import ConfigError, load_config

    cpu = min(os.sched_getaffinity(0))
    cfg = load_config("tiny_cpu", [f"trainer.cpus=[{cpu}]", f"rollout.server.cpus=[{cpu}]"])
    assert list(cfg.trainer.cpus) == [cpu] and list(cfg.rollout.server.cpus) == [cpu]
    with pytest.raises(ConfigError, match=r"'trainer.cpus' names CPUs \[4096\] that this machine does not have"):
        load_config("tiny_cpu", ["trainer.cpus=[4096]"])
    with pytest.raises(ConfigError, match=r"'rollout.server.cpus' must be a non-empty list"):
        load_config("tiny_cpu", ["rollout.server.cpus=[]"])
