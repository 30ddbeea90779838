"""publisher/compat.py: the default compatibility matrix, per recipe and per library."""

from __future__ import annotations

from publisher import compat, recipe_args, recipes
from publisher.verify import envs

HERE = {"torch": "2.13.0+cpu", "torchao": "0.18.0", "diffusers": "0.42.1", "transformers": "5.23.0"}


def _specs(recipe: str | None, libraries: set[str]) -> list[str]:
    classes = recipes.get(recipe).tensor_classes if recipe else None  # the matrix follows what the config makes
    return [e.spec for e in compat.default_matrix(classes, libraries, HERE)]


def test_every_entry_pins_one_package_exactly() -> None:
    for entry in compat.DEFAULT_MATRIX:
        spec = envs.parse_spec(entry.spec)
        assert spec.names == (entry.package,) and spec.text == entry.spec == f"{entry.package}=={entry.version}"
        assert entry.why and set(entry.libraries) <= {"diffusers", "transformers"}
        made = {c for r in recipes.all_recipes() for c in r.tensor_classes}
        assert entry.tensor_classes is None or set(entry.tensor_classes) <= made


def test_pipeline_int8_runs_the_oldest_claims_and_the_known_silent_versions() -> None:
    # torchao 0.18.0 is this environment (always checked), so it is left out
    assert _specs("int8wo", {"diffusers"}) == ["torchao==0.17.0", "torchao==0.15.0", "diffusers==0.39.0", "diffusers==0.38.0"]
    assert _specs("int8dq", {"diffusers"}) == _specs("int8wo", {"diffusers"})
    # a config, not a name: any config that makes Int8Tensor weights runs the int8 entry
    grouped = recipe_args.parse(["Int8WeightOnlyConfig(granularity=PerGroup(128))"])[0]
    assert [e.spec for e in compat.default_matrix(grouped.tensor_classes, {"diffusers"}, HERE)] == _specs("int8wo", {"diffusers"})
    assert "torchao==0.15.0" not in _specs("intx4wo", {"diffusers"})


def test_float8_and_transformers() -> None:
    assert _specs("float8wo", {"diffusers"}) == ["torchao==0.17.0", "diffusers==0.39.0", "diffusers==0.38.0"]
    assert _specs("int8wo", {"transformers"}) == ["torchao==0.17.0", "torchao==0.15.0", "transformers==5.0.0", "transformers==4.57.6"]
    assert _specs("float8wo", {"diffusers", "transformers"}) == [
        "torchao==0.17.0", "diffusers==0.39.0", "diffusers==0.38.0", "transformers==5.0.0", "transformers==4.57.6"]
    # a repo another tool made (no recipe recorded): only the entries for every recipe
    assert _specs(None, {"diffusers"}) == ["torchao==0.17.0", "diffusers==0.39.0", "diffusers==0.38.0"]


def test_an_entry_equal_to_this_environment_is_left_out() -> None:
    older = {**HERE, "torchao": "0.19.0"}
    assert "torchao==0.18.0" in [e.spec for e in compat.default_matrix(("Float8Tensor",), {"diffusers"}, older)]
