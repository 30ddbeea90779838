"""publisher/verify/envs.py: version specs, and environments layered on this one (built offline from a local wheel)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from publisher.errors import EnvBuildError, UsageError
from publisher.testing.wheels import write_wheel
from publisher.verify import envs


def test_specs_and_interpreters_are_told_apart() -> None:
    for spec in ("diffusers==0.39.0", "torchao==0.17.*", "transformers==4.57.6,diffusers==0.39.0", "diffusers>=0.38,<0.40"):
        assert envs.is_spec(spec), spec
    for path in ("/venv/bin/python", "./python", "python3", "C:\\venv\\python.exe", "diffusers"):
        assert not envs.is_spec(path), path


def test_spec_normal_form() -> None:
    spec = envs.parse_spec(" Transformers==4.57.6 , diffusers==0.39.0")
    assert spec.text == "diffusers==0.39.0,transformers==4.57.6"  # sorted, canonical: the cache key and the name shown
    assert spec.names == ("diffusers", "transformers")
    assert envs.parse_spec("torchao==0.17.*").requirements == ("torchao==0.17.*",)
    # a comma inside one package's range stays with it
    assert envs.parse_spec("diffusers>=0.38,<0.40").names == ("diffusers",)
    assert envs.parse_spec("huggingface_hub==0.36.2").text == "huggingface-hub==0.36.2"


@pytest.mark.parametrize("text, message", [
    ("diffusers==0.39.0,diffusers==0.40.0", "named twice"),
    ("diffusers==0.39.0,transformers", "transformers has no version"),
    ("diffusers @ https://example.com/d.whl", "only a package name and versions"),
    ("diffusers==1; python_version<'3'", "only a package name and versions"),
    ("==1.0", "not a version spec"),
])
def test_bad_specs_are_usage_errors(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message) as info:
        envs.parse_spec(text, "--compat")
    assert str(info.value).startswith(f"--compat {text!r}")  # names the option and the value


def test_cache_key_follows_the_spec_and_this_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = envs.parse_spec("diffusers==0.38.0"), envs.parse_spec("diffusers==0.39.0")
    before = envs.cache_key(a)
    assert before == envs.cache_key(envs.parse_spec("diffusers==0.38.0")) != envs.cache_key(b)
    real = envs.installed_versions
    monkeypatch.setattr(envs, "installed_versions", lambda paths=None: {**real(paths), "torch": "9.9.9"})
    assert envs.cache_key(a) != before  # another torch here: the layer is rebuilt


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """pip sees only a folder with two versions of a made-up package."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for version in ("1.0", "2.0"):
        write_wheel(wheels, "hfao-probe", version, f"VERSION = {version!r}\n")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("HF_AO_PUBLISH_ENVS", str(tmp_path / "envs"))
    return wheels


def test_build_layers_on_this_environment_and_is_reused(local_index: Path, tmp_path: Path) -> None:
    spec = envs.parse_spec("hfao-probe==1.0")
    started = time.monotonic()
    env = envs.build(spec)
    cold = time.monotonic() - started
    assert not env.reused and env.packages == {"hfao-probe": "1.0"}
    assert env.path.parent == tmp_path / "envs" and env.path.name.startswith("hfao-probe-1.0-")
    record = json.loads((env.path / envs.RECORD).read_text())
    assert record["spec"] == "hfao-probe==1.0" and record["packages"] == {"hfao-probe": "1.0"}
    # the layer holds the probe and sees everything installed here (torch, click) at this environment's versions
    code = ("import hfao_probe, click, importlib.metadata as md, json; "
            "print(json.dumps([hfao_probe.VERSION, hfao_probe.__file__, md.version('click'), md.version('torch')]))")
    out = json.loads(subprocess.run([env.python, "-c", code], capture_output=True, text=True, check=True).stdout)
    import importlib.metadata as md

    assert out[0] == "1.0" and out[1].startswith(str(env.path)) and out[2] == md.version("click") and out[3] == md.version("torch")
    assert not any(p.name.startswith(".building") for p in (tmp_path / "envs").iterdir())  # no half-built entry left
    started = time.monotonic()
    again = envs.build(spec)
    assert again.reused and again.path == env.path and again.packages == env.packages
    assert time.monotonic() - started < max(1.0, cold / 2)


def test_a_spec_that_cannot_be_built_names_itself_and_leaves_nothing(local_index: Path, tmp_path: Path) -> None:
    with pytest.raises(EnvBuildError) as info:
        envs.build(envs.parse_spec("hfao-probe==3.0"))
    message = str(info.value)
    assert message.startswith("cannot build the verification environment hfao-probe==3.0: pip install failed: ")
    assert "hfao-probe==3.0" in message.split("failed: ", 1)[1] and "\n" not in message
    assert not [p for p in (tmp_path / "envs").iterdir()]


def test_a_spec_equal_to_this_environment_is_refused(local_index: Path) -> None:
    import importlib.metadata as md

    with pytest.raises(EnvBuildError, match=r"is this environment for click"):
        envs.build(envs.parse_spec(f"click=={md.version('click')}"))


def test_a_broken_leftover_is_rebuilt(local_index: Path) -> None:
    spec = envs.parse_spec("hfao-probe==2.0")
    first = envs.build(spec)
    (first.path / envs.RECORD).unlink()  # as if a build had been cut short after its rename (never happens; or deleted)
    again = envs.build(spec)
    assert not again.reused and again.path == first.path and again.packages == {"hfao-probe": "2.0"}
    assert (again.path / envs.RECORD).is_file()
