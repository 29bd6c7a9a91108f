"""``python -m nemo_dapo.engines.server --options-file``: the engine's constructor options from a JSON file (the one
``nemo_dapo.cluster.engine_options`` writes for containers/dapo.sbatch), merged under the ``--option`` pairs."""
import json
import re

import pytest

from nemo_dapo.engines import protocol as P
from nemo_dapo.engines import server as S


class _Built(Exception):
    pass


@pytest.fixture
def built(monkeypatch):
    """Stops main() at the engine constructor and records what it was given."""
    seen = {}
    # main() takes the key out of its environment (the engine's workers do not inherit it): set it for every call
    monkeypatch.setattr(S.P, "read_authkey", lambda: b"k" * P.MIN_KEY_BYTES)

    def fake_make_engine(name, model_dir, options):
        seen.update(name=name, model=model_dir, options=options)
        raise _Built

    monkeypatch.setattr(S, "make_engine", fake_make_engine)
    return seen


def run(*args):
    with pytest.raises(_Built):
        S.main(["--engine", "trtllm", "--model", "/hf/m", "--address", "unix:/tmp/x.sock", *args])


def test_options_file_is_merged_under_the_option_pairs(built, tmp_path):
    f = tmp_path / "engine_options.json"
    f.write_text(json.dumps({"engine": "trtllm", "engine_gpus": 8,
                             "options": {"max_batch_size": 256, "tensor_parallel_size": 8, "dtype": "bfloat16"}}))
    run("--options-file", str(f), "--option", "max_batch_size=64", "--option", "enable_sleep=false")
    assert built["options"] == {"max_batch_size": 64, "tensor_parallel_size": 8, "dtype": "bfloat16",
                                "enable_sleep": False}
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"free_gpu_memory_fraction": 0.3}))
    run("--options-file", str(bare))
    assert built["options"] == {"free_gpu_memory_fraction": 0.3}


def refused(capsys, *args):
    """main()'s exit code and its stderr, which must be one ``error:`` line."""
    code = S.main(["--engine", "trtllm", "--model", "/m", "--address", "unix:/tmp/x", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0] and "Traceback" not in err[0], err
    return code, err[0]


def test_bad_options_files_are_refused_naming_the_file(built, tmp_path, capsys):
    bad = tmp_path / "broken.json"
    bad.write_text('{"max_batch_size": 256,')
    code, err = refused(capsys, "--options-file", str(bad))
    assert code == 2 and re.search(r"--options-file '.*broken.json': not valid JSON", err)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    code, err = refused(capsys, "--options-file", str(listed))
    assert code == 2 and re.search("list.json.*expected a JSON object of engine options, got list", err)
    other = tmp_path / "vllm.json"
    other.write_text(json.dumps({"engine": "vllm", "engine_gpus": 1, "options": {}}))
    code, err = refused(capsys, "--options-file", str(other))
    assert code == 2 and "holds options for engine 'vllm', not for --engine 'trtllm'" in err
    code, err = refused(capsys, "--options-file", str(tmp_path / "missing.json"))
    assert code == 2 and re.search("missing.json.*cannot read it", err)
    assert built == {}  # no engine was built from a bad file
