"""The same request through every entry point (issue 37): the CLI, the Action (its inputs turned into the CLI's
arguments, action/inputs.py) and a Hugging Face Job (the command line its job runs, hfjobs/remote.job_args), for every
form `--quant` takes, with the quality evaluation on. Each must reach the publish job as the same recipes (the same
configs per component and per layer) and the same evaluation settings.

Fast: the publish job and the Jobs submission are replaced by recorders (the full publishes of the combinations the
docs show run in tests/test_docs_commands.py and tests/test_docs_action.py, with the defaults on).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from publisher.request import Outcome, PublishRequest

MODEL = "bfl/tiny-flux"  # a Hub id: what all three entry points take (a Job cannot read a local folder)
LAYERS = {"re:single_transformer_blocks\\..*": "float8wo", "proj_out": None,
          "x_embedder": "Int8WeightOnlyConfig(granularity=PerGroup(64))"}


def _write_json_config(path: Path) -> None:
    from torchao.core.config import config_to_dict
    from torchao.quantization import Int8WeightOnlyConfig, PerGroup

    path.write_text(json.dumps(config_to_dict(Int8WeightOnlyConfig(granularity=PerGroup(64)))))


# form -> (the CLI's arguments, the Action's inputs); FILE is the form's file in the working folder
FORMS: dict[str, tuple[list[str], dict[str, str]]] = {
    "recipe": (["--quant", "int8wo,float8wo"], {"quant": "int8wo\nfloat8wo"}),
    "call": (["--quant", "IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))"],
             {"quant": "IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))"}),
    "json file": (["--quant", "FILE"], {"quant": "FILE"}),
    "mapping": (["--quant", "transformer=float8wo,text_encoder_2=int8wo"],
                {"quant": "transformer=float8wo,text_encoder_2=int8wo"}),
    "layer-config": (["--quant", "intx4wo", "--layer-config", "FILE"],
                     {"quant": "intx4wo", "extra-args": "--layer-config FILE"}),
}


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """job.run and remote.publish replaced by recorders of what reaches them."""
    from publisher import job
    from publisher.hfjobs import remote

    seen: dict[str, list[Any]] = {"runs": [], "jobs": []}

    def run(req: PublishRequest) -> list[Outcome]:
        seen["runs"].append(req)
        return [Outcome(recipe="x", repo_id="alice/x", verified=True)]

    def publish(request: Any) -> list[Any]:
        seen["jobs"].append(request)
        return []

    monkeypatch.setattr(job, "run", run)
    monkeypatch.setattr(remote, "publish", publish)
    monkeypatch.setenv("HF_TOKEN", "tok_alice")
    return seen


def _invoke(args: list[str], env: dict[str, str] | None = None) -> None:
    from publisher.cli import main

    result = CliRunner().invoke(main, args, env=env, catch_exceptions=False)
    assert result.exit_code == 0, (args, result.output)


def _what_reaches_the_job(req: PublishRequest) -> tuple[Any, ...]:
    """The request as the job reads it: each recipe's configs (per component, per layer; how they were given left
    out: a file here is inline in a Job) and the evaluation's settings."""
    from publisher import recipe_args

    def configs(value: Any) -> Any:  # how a config was given (a file here, inline in a Job) left out
        if isinstance(value, dict):
            return {k: configs(v) for k, v in value.items() if k not in ("given", "source", "file", "origin")}
        return [configs(v) for v in value] if isinstance(value, list) else value

    recipes = [(r.name, configs(r.quant_json()), r.python) for r in recipe_args.parse(req.make.quant, req.make.layer_config)]
    return req.base.model, recipes, req.checks.evaluation, req.checks.compat


@pytest.mark.parametrize("form", FORMS)
def test_the_same_request_reaches_the_job_from_every_entry_point(form: str, recorded: dict[str, list[Any]],
                                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from action.inputs import build_request
    from publisher.hfjobs import remote

    monkeypatch.chdir(tmp_path)
    file = tmp_path / ("config.json" if form == "json file" else "layers.json")  # the form's file, if it has one
    if form == "json file":
        _write_json_config(file)
    elif form == "layer-config":
        file.write_text(json.dumps(LAYERS))
    cli_args, inputs = FORMS[form]
    cli_args = [str(file) if a == "FILE" else a for a in cli_args]
    budget = {"HF_AO_PUBLISH_EVAL_BUDGET": "90s"}  # an option from the environment (this invocation's) reaches a Job too

    _invoke([MODEL, *cli_args], budget)
    local = _what_reaches_the_job(recorded["runs"][-1])
    assert local[2] is not None and local[2].budget_s == 90 and local[2].enabled  # the evaluation is on

    env = {f"HFAO_{k.upper().replace('-', '_')}": v.replace("FILE", str(file)) for k, v in inputs.items()}
    action = build_request({"HFAO_MODEL": MODEL, "HFAO_TOKEN": "tok_alice", **env})
    _invoke(action.args, budget)  # the runner's environment: a workflow's env: sets it for the action's steps
    assert _what_reaches_the_job(recorded["runs"][-1]) == local, "the Action"

    _invoke([MODEL, *cli_args, "--on-hf-jobs", "cpu-basic"], budget)
    jobs = recorded["jobs"][-1]
    assert _what_reaches_the_job(jobs.publish) == local, "the --on-hf-jobs request"
    from publisher import recipe_args


    reached = []
    for recipe in recipe_args.parse(jobs.publish.make.quant, jobs.publish.make.layer_config):  # one job per recipe
        argv = remote.job_args(jobs, recipe, f"alice/x-{recipe.name}", "0" * 40)
        assert not any(a == str(file) for a in argv)  # no local file named: a job cannot read it
        _invoke(argv)  # the job's machine has none of our variables
        job = _what_reaches_the_job(recorded["runs"][-1])
        assert job[2:] == local[2:] and job[0] == MODEL, "the job's own command line"
        reached += job[1]
    assert reached == local[1]  # together, the jobs publish exactly the recipes asked here
