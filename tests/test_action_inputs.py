"""action/inputs.py: the action's inputs (HFAO_* variables) -> the CLI's argv list, and what is refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from action.inputs import (
    ActionInputError,
    build_request,
    parse_bool,
    parse_matrix,
    parse_quant,
    secret_values,
    split_list,
)

SMALL = "--sample-steps 2 --sample-size 64"


def test_bool_inputs_are_strings() -> None:
    assert parse_bool("x", "true", False) is True
    assert parse_bool("x", "False", True) is False
    assert parse_bool("x", "", True) is True
    for bad in ("yes", "1", "on", "true "):
        if bad.strip() in ("true",):
            continue
        with pytest.raises(ActionInputError, match="'true' or 'false'"):
            parse_bool("x", bad, False)


def test_lists_split_on_commas_spaces_and_newlines() -> None:
    assert split_list(" a, b\nc  d,,") == ["a", "b", "c", "d"]
    assert split_list("") == [] and split_list(None) == []


def _env(**kw: str) -> dict[str, str]:
    base = {"HFAO_MODEL": "bfl/tiny-flux", "HFAO_QUANT": "int8wo", "HFAO_TOKEN": "tok_x"}
    base.update({f"HFAO_{k.upper()}": v for k, v in kw.items()})
    return base


def test_request_argv() -> None:
    req = build_request(_env(QUANT="int8wo, int8dq\nfloat8wo", COMPONENTS="transformer text_encoder_2",
                             EXCLUDE="a.b\nc", REPO_ID="acme/x-{recipe}", REVISION=" main ", PRIVATE="True",
                             CREATE_PR="false", EXTRA_ARGS=f"{SMALL} --sample-prompt \"a cat's 'x'\" $(id)"))
    assert req.args == ["publish", "bfl/tiny-flux", "--quant=int8wo, int8dq", "--quant=float8wo",
                        "--components=transformer,text_encoder_2", "--exclude=a.b", "--exclude=c",
                        "--repo-id=acme/x-{recipe}", "--revision=main", "--private",
                        "--sample-steps", "2", "--sample-size", "64", "--sample-prompt", "a cat's 'x'", "$(id)"]
    assert req.push and req.token == "tok_x" and "tok_x" not in repr(req)
    assert not build_request(_env(PUSH="false", TOKEN="")).push
    assert not build_request(_env(EXTRA_ARGS="--no-push", TOKEN="")).push
    assert build_request({**_env(TOKEN=""), "HF_TOKEN": "tok_env"}).token == "tok_env"


CALL = "IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))"
MAPPING = "transformer=float8wo,text_encoder_2=int8wo"


def test_quant_is_one_cli_value_per_line() -> None:
    """Each line reaches the CLI whole as one --quant (the CLI splits top-level commas itself), so a config call's and
    a mapping's commas and spaces stay; before, the input was split on every comma and space."""
    req = build_request(_env(QUANT=f"  {CALL}  \n\n{MAPPING}\nint8wo,float8wo\n"))
    assert req.args == ["publish", "bfl/tiny-flux", f"--quant={CALL}", f"--quant={MAPPING}", "--quant=int8wo,float8wo"]
    assert build_request(_env(QUANT=MAPPING)).args[2:] == [f"--quant={MAPPING}"]
    assert build_request(_env(QUANT='{"_type": "Int8WeightOnlyConfig", "_data": {}}')).args[2:] == [
        '--quant={"_type": "Int8WeightOnlyConfig", "_data": {}}']
    assert parse_quant(None) == [] and parse_quant(" \n ") == []


def test_quant_refuses_names_separated_by_spaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """'int8wo int8dq' on one line is two names where the CLI takes one value: refused before the install, with the fix;
    a file of that name in the workspace (a config_to_dict JSON) is a value."""
    with pytest.raises(ActionInputError, match=re.escape("input quant: 'int8wo int8dq' is several names on one line; "
                                                         "give one --quant value per line (or join recipes with commas: "
                                                         "int8wo,int8dq)")) as info:
        build_request(_env(QUANT="int8wo int8dq"))
    assert info.value.code == 2
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my config.json").write_text("{}")
    assert build_request(_env(QUANT="my config.json")).args[2:] == ["--quant=my config.json"]


def test_components_exclude_and_matrix_stay_lists() -> None:
    """The other list inputs keep their separators (commas, spaces, newlines): only quant is one value per line."""
    req = build_request(_env(COMPONENTS="transformer,\ntext_encoder_2", EXCLUDE="x_embedder, proj_out\nnorm_out.linear",
                             VERIFY_MATRIX="none"))
    assert req.args[3:] == ["--components=transformer,text_encoder_2", "--exclude=x_embedder", "--exclude=proj_out",
                            "--exclude=norm_out.linear", "--compat=none"]


def test_request_flags() -> None:
    req = build_request(_env(CREATE_PR="true", PUSH="false", KEEP_OUTPUT="true"))
    assert req.args == ["publish", "bfl/tiny-flux", "--quant=int8wo", "--create-pr", "--no-push"]
    assert not req.push and req.keep_output


def test_verify_matrix() -> None:
    assert build_request(_env()).args == ["publish", "bfl/tiny-flux", "--quant=int8wo"]  # empty: the CLI's default
    req = build_request(_env(VERIFY_MATRIX="default\ndiffusers==0.39.0  transformers==4.57.6,diffusers==0.39.0,\n",
                             EXTRA_ARGS="--keep-going"))
    assert req.args == ["publish", "bfl/tiny-flux", "--quant=int8wo", "--compat=default", "--compat=diffusers==0.39.0",
                        "--compat=transformers==4.57.6,diffusers==0.39.0", "--keep-going"]
    assert build_request(_env(VERIFY_MATRIX=" none ")).args[-1] == "--compat=none"
    assert parse_matrix("torchao==0.17.* diffusers>=0.38,<0.40") == ["torchao==0.17.*", "diffusers>=0.38,<0.40"]


@pytest.mark.parametrize("env, message", [
    (_env(MODEL=""), "model is required"),
    (_env(MODEL="--help"), "not an option"),
    (_env(QUANT=" , "), "quant is required"),
    (_env(TOKEN=""), "hf-token is required to push"),
    (_env(PRIVATE="yes"), "private must be 'true' or 'false'"),
    (_env(EXTRA_ARGS="--token tok_y"), "must not contain --token"),
    (_env(EXTRA_ARGS="--sample-steps 2 --token=tok_y"), "must not contain --token"),
    (_env(EXTRA_ARGS="--output-dir /x"), "must not contain --output-dir"),
    (_env(EXTRA_ARGS="--json"), "must not contain --json"),
    (_env(EXTRA_ARGS="--sample-prompt 'unclosed"), "cannot be parsed"),
    (_env(VERIFY_MATRIX="none default"), "verify-matrix: none cannot be combined"),
    (_env(VERIFY_MATRIX="diffusers"), "verify-matrix: 'diffusers' is not an environment"),
    (_env(VERIFY_MATRIX="/usr/bin/python3"), "verify-matrix: '/usr/bin/python3' is not an environment"),
    (_env(VERIFY_MATRIX="--debug"), "verify-matrix: '--debug' is not an environment"),
])
def test_request_rejects(env: dict[str, str], message: str) -> None:
    with pytest.raises(ActionInputError, match=re.escape(message)) as info:
        build_request(env)
    assert info.value.code == 2  # a usage error, as the CLI's own


def test_secret_values() -> None:
    assert secret_values({"HFAO_TOKEN": " tok_a\n", "HF_TOKEN": "tok_b"}) == ["tok_a", "tok_b"]
    assert secret_values({"HFAO_TOKEN": "", "OTHER": "x"}) == []


def test_run_on_hf_jobs() -> None:
    req = build_request(_env(RUN_ON="hf-jobs", HF_JOBS_FLAVOR="l4x1", QUANT="int4wo"))
    assert req.remote and req.args == ["publish", "bfl/tiny-flux", "--quant=int4wo", "--on-hf-jobs=l4x1"]
    assert not build_request(_env()).remote and not build_request(_env(RUN_ON="Runner")).remote


@pytest.mark.parametrize("env, message", [
    (_env(RUN_ON="gpu"), "run-on must be one of runner, hf-jobs"),
    (_env(RUN_ON="hf-jobs"), "hf-jobs-flavor must name a Jobs flavor"),
    (_env(RUN_ON="hf-jobs", HF_JOBS_FLAVOR="l4x1; rm -rf /"), "hf-jobs-flavor must name a Jobs flavor"),
    (_env(HF_JOBS_FLAVOR="l4x1"), "hf-jobs-flavor is only used with run-on: hf-jobs"),
    (_env(RUN_ON="hf-jobs", HF_JOBS_FLAVOR="l4x1", PUSH="false"), "push: 'false' would leave the repo folder in the job"),
    (_env(RUN_ON="hf-jobs", HF_JOBS_FLAVOR="l4x1", KEEP_OUTPUT="true"), "drop keep-output"),
    (_env(RUN_ON="hf-jobs", HF_JOBS_FLAVOR="l4x1", MODEL="./my-model"), "needs a Hub repo id as model"),
    (_env(RUN_ON="hf-jobs", HF_JOBS_FLAVOR="l4x1", TOKEN=""), "hf-token is required with run-on: hf-jobs"),
    (_env(EXTRA_ARGS="--on-hf-jobs l4x1"), "must not contain --on-hf-jobs"),
    (_env(EXTRA_ARGS="--attach 123"), "must not contain --attach"),
])
def test_run_on_rejects(env: dict[str, str], message: str) -> None:
    with pytest.raises(ActionInputError, match=re.escape(message)) as info:
        build_request(env)
    assert info.value.code == 2


def test_recheck_instead_of_a_publish() -> None:
    env = {"HFAO_RECHECK": "alice/a-int8wo\nmy-org/b-int8wo", "HFAO_TOKEN": "tok_x", "HFAO_VERIFY_MATRIX": "latest",
           "HFAO_EXTRA_ARGS": "--quiet"}
    req = build_request(env)
    assert req.recheck and not req.push and req.token == "tok_x" and req.model == "alice/a-int8wo, my-org/b-int8wo"
    assert req.args == ["recheck", "alice/a-int8wo", "my-org/b-int8wo", "--compat=latest", "--quiet"]
    for bad, message in (({"HFAO_MODEL": "bfl/tiny-flux"}, "drop model"), ({"HFAO_QUANT": "int8wo"}, "drop quant"),
                         ({"HFAO_TOKEN": ""}, "hf-token is required with recheck"),
                         ({"HFAO_RECHECK": "not-a-repo"}, "'not-a-repo' is not a Hub repo id"),
                         ({"HFAO_RUN_ON": "hf-jobs"}, "drop run-on")):
        with pytest.raises(ActionInputError, match=re.escape(message)):
            build_request({**env, **bad})



def test_models_go_to_the_cli_with_run_on_hf_jobs() -> None:
    env = {**_env(MODEL=""), "HFAO_MODELS": "org/a, org/b\norg/c", "HFAO_RUN_ON": "hf-jobs", "HFAO_HF_JOBS_FLAVOR": "l4x1"}
    req = build_request(env)
    assert req.args[:4] == ["publish", "org/a", "org/b", "org/c"] and req.args[-1] == "--on-hf-jobs=l4x1"
    assert req.remote and req.model == "org/a, org/b, org/c"
    assert build_request({**env, "HFAO_MODELS": "org/a"}).args[:3] == ["publish", "org/a", "--quant=int8wo"]
    for bad, message in (({"HFAO_RUN_ON": "runner", "HFAO_HF_JOBS_FLAVOR": ""}, "add run-on: hf-jobs and hf-jobs-flavor, "
                          "or run one model per job with a matrix over model"),
                         ({"HFAO_MODEL": "org/x"}, "give input model or input models, not both"),
                         ({"HFAO_MODELS": "org/a ./local"}, "a job cannot read './local'"),
                         ({"HFAO_MODELS": "org/a --json"}, "not an option: '--json'")):
        with pytest.raises(ActionInputError, match=re.escape(message)):
            build_request({**env, **bad})
