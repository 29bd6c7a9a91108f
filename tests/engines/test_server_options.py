"""``python -m nemo_dapo.engines.server --options-file``: the engine's constructor options from a JSON file (the one
``nemo_dapo.cluster.engine_options`` writes for containers/dapo.sbatch), merged under the ``--option`` pairs."""
import json

import pytest

from nemo_dapo.engines import server as S


class _Built(Exception):
    pass


@pytest.fixture
def built(monkeypatch):
    """Stops main() at the engine constructor and records what it was given."""
    seen = {}

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


def test_bad_options_files_are_refused_naming_the_file(built, tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text('{"max_batch_size": 256,')
    with pytest.raises(SystemExit, match=r"--options-file '.*broken.json': not valid JSON"):
        S.main(["--engine", "trtllm", "--model", "/m", "--address", "unix:/tmp/x", "--options-file", str(bad)])
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="list.json.*expected a JSON object of engine options, got list"):
        S.main(["--engine", "trtllm", "--model", "/m", "--address", "unix:/tmp/x", "--options-file", str(listed)])
    other = tmp_path / "vllm.json"
    other.write_text(json.dumps({"engine": "vllm", "engine_gpus": 1, "options": {}}))
    with pytest.raises(SystemExit, match="holds options for engine 'vllm', not for --engine 'trtllm'"):
        S.main(["--engine", "trtllm", "--model", "/m", "--address", "unix:/tmp/x", "--options-file", str(other)])
    with pytest.raises(SystemExit, match="missing.json.*cannot read it"):
        S.main(["--engine", "trtllm", "--model", "/m", "--address", "unix:/tmp/x",
                "--options-file", str(tmp_path / "missing.json")])
    assert built == {}  # no engine was built from a bad file
