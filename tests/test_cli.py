"""The nemo-dapo command line: subcommands, config printing, errors as exit code 2 with the key named."""
import pytest

from nemo_dapo.cli import SUBCOMMANDS, build_parser, main


def test_subcommands_are_registered_in_one_list():
    names = [name for name, *_ in SUBCOMMANDS]
    assert names[:3] == ["train", "eval", "plot"]
    help_text = build_parser().format_help()
    assert all(name in help_text for name in names)


def test_no_subcommand_prints_help(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_train_print_config_applies_overrides(capsys):
    assert main(["train", "--print-config", "trainer.max_steps=7", "++model.extra.attention_bias=false"]) == 0
    out = capsys.readouterr().out
    assert "max_steps: 7" in out and "attention_bias: false" in out and "name: tiny_cpu" in out
    assert main(["train", "-cn", "tiny_cpu_grpo", "--print-config"]) == 0
    assert "agg: seq-mean-token-mean" in capsys.readouterr().out


@pytest.mark.parametrize("argv, fragment", [
    (["train", "--print-config", "optim.lr=fast"], "optim.lr"),
    (["train", "--print-config", "algorithm.dynamic_sampling.max_gen_batch=3"], "max_gen_batches"),
    (["train", "--config-name", "nope"], "known configs"),
    (["plot", "/nonexistent/run"], "metrics.jsonl"),
])
def test_errors_exit_2_and_name_the_problem(argv, fragment, capsys):
    assert main(argv) == 2
    assert fragment in capsys.readouterr().err


def test_budget_exhausted_exits_3_with_the_keys(monkeypatch, capsys):
    import nemo_dapo.local.run as run_mod
    from nemo_dapo.core.dynamic_sampling import BudgetExhausted

    def exhausted(cfg, **kwargs):
        raise BudgetExhausted("dynamic sampling kept 0 of 16 groups; raise max_gen_batches")

    monkeypatch.setattr(run_mod, "train", exhausted)
    assert main(["train", "trainer.max_steps=1"]) == 3
    assert "algorithm.dynamic_sampling" in capsys.readouterr().err
