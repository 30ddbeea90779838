"""Configs as users give them (publisher/configs/, publisher/recipes.py, publisher/recipe_args.py): the call-syntax
reader and its allowlist, JSON configs, per-component mappings, per-layer tables, the registry's derived facts, the
recipe names, and the card's Python. Unit tier: no model, no publish (tests/test_publish_configs.py publishes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from publisher import adapters, recipe_args, recipes
from publisher.configs import layers, render, spec, syntax
from publisher.configs.facts import facts_for
from publisher.errors import HardwareError, UsageError

INTX4 = "IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))"


# ---------------------------------------------------------------- the call syntax

@pytest.mark.parametrize("text", [
    "Int8WeightOnlyConfig(granularity=PerGroup(128))",
    INTX4,
    "Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))",
    "IntxWeightOnlyConfig(weight_dtype=torch.int2, granularity=PerAxis(0), mapping_type=MappingType.ASYMMETRIC)",
    "Float8DynamicActivationFloat8WeightConfig(granularity=[PerRow(), PerRow()], activation_value_ub=-1e3)",
    'Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")',
    "FqnToConfig({'re:.*attn.*': Int8WeightOnlyConfig(), 'proj_out': None})",
])
def test_the_call_syntax_builds_the_config_torchao_builds(text: str) -> None:
    import torch  # noqa: F401
    from torchao import quantization as q
    from torchao.quantization import MappingType, PerAxis, PerGroup, PerRow  # noqa: F401 - the names the text uses

    parsed = syntax.parse(text)
    expected = eval(text, {**vars(q), "torch": torch, "MappingType": MappingType})  # noqa: S307 - the test's own constants
    assert render.canonical(parsed.config) == render.canonical(expected)
    # its imports build it too, and the rendering reads back as the same config
    namespace: dict[str, Any] = {}
    exec(parsed.imports() + f"\nconfig = {text}", namespace)  # noqa: S102 - generated from the test's constants
    assert render.canonical(namespace["config"]) == render.canonical(expected)
    call, _, _ = render.write(parsed.config)
    assert render.canonical(syntax.parse(call).config) == render.canonical(expected)


@pytest.mark.parametrize(("text", "said"), [
    ("Int8WeightOnlyConfig(granularity=os.path)", "attribute access is limited"),
    ("Int8WeightOnlyConfig(granularity=PerRow().__class__)", "attribute access is limited"),
    ("IntxWeightOnlyConfig(mapping_type=MappingType.__class__)", "has no member __class__"),
    ("IntxWeightOnlyConfig(weight_dtype=torch.nn)", "not a torch dtype"),
    ("__import__('os').system('true')", "a config is a call of a torchao config class"),
    ("Int8WeightOnlyConfig(granularity=__import__('os'))", "not a torchao config, granularity or helper class"),
    ("eval('1')", "a config is a call of a torchao config class"),
    ("Int8WeightOnlyConfig(granularity=print('x'))", "not a torchao config, granularity or helper class"),
    ("import os", "is not a config call"),
    ("Int8WeightOnlyConfig(x[0])", "a subscript"),
    ("Int8WeightOnlyConfig(granularity=PerGroup(64 * 2))", "an operator"),
    ("Int8WeightOnlyConfig(granularity=(lambda: PerRow())())", "only torchao config"),
    ("Int8WeightOnlyConfig(group_size=f'{1}')", "an f-string"),
    ("Int8WeightOnlyConfig(**{'group_size': 1})", "**kwargs unpacking"),
    ("Int8WeightOnlyConfig(*[1])", "*args unpacking"),
    ("Int8WeightOnlyConfig(_private=1)", "starts with an underscore"),
    ("Int8WeightOnlyConfig(granularity=granularity)", "variables are not allowed"),
    ("Int8WeightOnlyConfig(granularity=PerRow)", "a class must be called"),
    ("Int8WeightOnlyConfig(granularity=PerRow(), version=(v := 2))", "an assignment"),
    ("Int8WeightOnlyConfig(b'x')", "only numbers, strings"),
    ("Int8WeightOnlyConig()", "did you mean Int8WeightOnlyConfig?"),
    ("Int8WeightOnlyConfig(" + "1, " * syntax.MAX_TEXT + ")", "characters long"),
])
def test_the_parser_refuses_anything_outside_its_allowlist(text: str, said: str) -> None:
    with pytest.raises(UsageError, match="^--quant[ :]") as caught:
        syntax.parse(text)
    assert said in str(caught.value)
    assert "\n" not in str(caught.value)
    if said not in ("did you mean Int8WeightOnlyConfig?", "not a torch dtype"):  # which names torchao has: the full read
        with pytest.raises(UsageError):  # the torchao-free shape check refuses the same
            syntax.check_shape(text)


def test_a_rejected_config_names_the_argument_and_torchao_s_working_form() -> None:
    with pytest.raises(syntax.Rejected) as caught:
        syntax.parse("Int8WeightOnlyConfig(group_size=128, version=2)")
    message = str(caught.value)
    assert message.startswith("--quant 'Int8WeightOnlyConfig(group_size=128, version=2)': torchao rejects")
    assert "AssertionError: Only support version 2 with group_size=None, got 128" in message
    assert message.endswith("the working form: Int8WeightOnlyConfig(granularity=PerGroup(128))")
    with pytest.raises(syntax.Rejected, match=r"did you mean granularity=\?"):
        syntax.parse("Int8WeightOnlyConfig(granularty=PerRow())")
    with pytest.raises(syntax.Rejected, match=r"weight_dtype must be torch.intx"):
        syntax.parse("IntxWeightOnlyConfig(weight_dtype=torch.uint4)")
    # the same through config_to_dict JSON (torchao's own config_from_dict)
    bad = {"_type": "Int8WeightOnlyConfig", "_version": 2, "_data": {"group_size": 128}}
    with pytest.raises(syntax.Rejected, match="torchao rejects Int8WeightOnlyConfig"):
        spec.from_dict(bad, "--quant", json.dumps(bad))


def test_the_shape_check_imports_no_torch() -> None:
    code = ("import sys\nfrom publisher.configs import syntax, spec\nfrom publisher import recipe_args\n"
            f"syntax.check_shape({INTX4!r})\n"
            "recipe_args.precheck(['int8wo,transformer=int8wo'] if False else ['transformer=float8wo,text_encoder_2=int8wo'])\n"
            "print(sorted(m for m in ('torch', 'torchao', 'diffusers', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# ---------------------------------------------------------------- --quant values

def test_quant_values_split_on_top_level_commas_only() -> None:
    assert spec.split_top(f"int8wo,{INTX4}, float8wo") == ["int8wo", INTX4, "float8wo"]
    assert spec.split_top("FqnToConfig({'a': Int8WeightOnlyConfig(), 'b,c': None})") == [
        "FqnToConfig({'a': Int8WeightOnlyConfig(), 'b,c': None})"]
    units = spec.parse_quant([f"int8wo,{INTX4}", f"transformer={INTX4},text_encoder_2=int8wo"], recipes.CALLS)
    assert [u.given for u in units] == ["int8wo", INTX4, f"transformer={INTX4},text_encoder_2=int8wo"]
    assert units[0].default is not None and units[0].default.recipe == "int8wo"
    assert [c for c, _ in units[2].mapping] == ["transformer", "text_encoder_2"]
    assert units[2].for_component("text_encoder_2").recipe == "int8wo"
    with pytest.raises(UsageError, match="mixes COMPONENT=CONFIG pairs with plain recipes"):
        spec.parse_quant(["transformer=int8wo,float8wo"], recipes.CALLS)
    with pytest.raises(UsageError, match="names component transformer twice"):
        spec.parse_quant(["transformer=int8wo,transformer=float8wo"], recipes.CALLS)
    with pytest.raises(UsageError, match=r"unknown recipe 'int3' \(did you mean int8wo\?\); choose one of: int8wo, "):
        spec.parse_quant(["int3"], recipes.CALLS)
    for typed in ("INT8WO", "Int8wo", "int8w0", "in8wo"):  # another case, a zero for an o, a letter left out
        with pytest.raises(UsageError, match=rf"unknown recipe '{typed}' \(did you mean int8wo\?\)"):
            spec.parse_quant([typed], recipes.CALLS)
    with pytest.raises(UsageError, match=r"unknown recipe 'Float8DQ-Tensor' \(did you mean float8dq-tensor\?\)"):
        spec.parse_quant(["transformer=Float8DQ-Tensor"], recipes.CALLS)
    with pytest.raises(UsageError, match=r"unknown recipe 'xyz'; choose one of"):  # nothing close: no guess
        spec.parse_quant(["xyz"], recipes.CALLS)


def test_a_json_config_file_in_config_to_dict_form(tmp_path: Path) -> None:
    from torchao.core.config import config_to_dict

    config = syntax.parse(INTX4).config
    path = tmp_path / "intx4.json"
    path.write_text(json.dumps(config_to_dict(config), indent=2))
    found = spec.parse_value(str(path), "--quant", recipes.CALLS)
    assert found.source == "json" and found.origin == str(path) and found.given == path.read_text().strip()
    assert found.canonical == render.canonical(config)
    assert render.canonical(syntax.parse(found.call).config) == found.canonical  # its Python is the call syntax
    inline = spec.parse_value(json.dumps(config_to_dict(config)), "--quant", recipes.CALLS)
    assert inline.canonical == found.canonical
    (tmp_path / "bad.json").write_text('{"_type": "Int8WeightOnlyConfig"}')
    with pytest.raises(UsageError, match="config_to_dict form"):
        spec.parse_value(str(tmp_path / "bad.json"), "--quant", recipes.CALLS)
    with pytest.raises(UsageError, match=rf"^--quant '{tmp_path}/missing.json': no such file: {tmp_path}/missing.json; "
                                          "--quant takes a recipe name, a config call or a config_to_dict JSON file$"):
        spec.parse_value(str(tmp_path / "missing.json"), "--quant", recipes.CALLS)
    (tmp_path / "evil.json").write_text('{"_type": "Popen", "_data": {"args": ["true"]}}')
    with pytest.raises(UsageError, match="Failed to find class Popen"):
        spec.parse_value(str(tmp_path / "evil.json"), "--quant", recipes.CALLS)


# ---------------------------------------------------------------- the registry and the names

OLD_REGISTRY = {  # the facts the registry stated by hand before they were derived from the configs
    "int8wo": ("Int8Tensor", False, None, False, 8), "int8dq": ("Int8Tensor", False, None, False, 8),
    "float8wo": ("Float8Tensor", False, None, False, 8), "float8dq": ("Float8Tensor", True, (8, 9), True, 8),
    "float8dq-tensor": ("Float8Tensor", True, (8, 9), True, 8), "int4wo": ("Int4TilePackedTo4dTensor", True, (8, 0), False, 4),
}


def test_named_recipes_are_configs_and_their_facts_are_derived() -> None:
    for recipe in recipes.all_recipes():
        entry = next(e for e in recipes.ENTRIES if e.name == recipe.name)
        assert recipe.named and recipe.expression == entry.config
        assert render.canonical(recipe.config_for()) == render.canonical(syntax.parse(entry.config).config)
        if recipe.name in OLD_REGISTRY:
            cls, cuda, cc, cpu_made, bits = OLD_REGISTRY[recipe.name]
            assert (recipe.tensor_class, recipe.quantize.cuda, recipe.quantize.min_cc, recipe.cpu_producible) == (cls, cuda, cc, cpu_made)
            assert recipe.run == recipe.quantize or not cuda
            assert int(recipe.bits) == bits
    for name in ("intx4wo", "int8dq-int4"):  # the CPU int4 recipes: made and run on a CPU, stored in int8 space
        recipe = recipes.get(name)
        assert recipe.tensor_class == "IntxUnpackedToInt8Tensor" and not recipe.quantize.cuda and not recipe.run.cuda
        assert recipe.bits == 8.75
        assert "stored unpacked, one per int8 byte" in recipe.to_dict()["storage"] and "the size of int8" in recipe.to_dict()["storage"]
        assert recipe.smallest_flavors()["quantize"][0].name == "cpu-basic"
    assert "exec(" not in Path(recipes.__file__).read_text() and "eval(" not in Path(recipes.__file__).read_text()


def test_gpu_only_and_unpublishable_configs_are_refused_early() -> None:
    int4 = recipe_args.parse(["Int4WeightOnlyConfig()"])[0]
    assert int4.needs_gpu_to_quantize and int4.quantize.packages == ("mslk",)
    with pytest.raises(HardwareError, match="needs a CUDA GPU and mslk to quantize, and this machine has none"):
        recipes.check_can_quantize(int4, probe=False)
    with pytest.raises(HardwareError, match="int4wo needs a CUDA GPU with compute capability >= 8.0"):
        recipe_args.precheck(["int4wo"])  # the device rules alone, before torchao is imported
    # the way out on Hugging Face Jobs, with the smallest flavors that have such a GPU (`recipes` lists the same)
    jobs = r"add --on-hf-jobs FLAVOR to run it on Hugging Face Jobs \(l4x1 or a10g-small; `hf-ao-publish recipes` lists"
    assert recipes.get("int4wo").hf_jobs_text().startswith("quantize, run, benchmark: l4x1 (L4, CC 8.9), a10g-small")
    with pytest.raises(HardwareError, match=rf"this machine has none; {jobs} the flavors\), run it on such a GPU, or pick"):
        recipes.check_can_quantize(recipes.get("int4wo"), probe=False)
    with pytest.raises(HardwareError, match=rf"to quantize; this GPU has 7.5; {jobs} the flavors\), or run it on a GPU"):
        recipes.check_can_quantize(recipes.get("int4wo"), (7, 5))
    with pytest.raises(UsageError, match="Int4PreshuffledTensor weights, which torchao 0.18 cannot save as safetensors"):
        recipe_args.parse(['Int4WeightOnlyConfig(int4_packing_format="preshuffled")'])
    with pytest.raises(UsageError, match="torchao cannot quantize .* Unsupported int4 packing format: bogus"):
        recipe_args.parse(['Int4WeightOnlyConfig(int4_packing_format="plain_int32x")'] if False else
                          ['Int4WeightOnlyConfig(int4_packing_format="bogus")'])
    fp8 = recipe_args.parse(["Float8DynamicActivationFloat8WeightConfig()"])[0]
    assert fp8.cpu_producible and not fp8.needs_gpu_to_quantize and fp8.run.min_cc == (8, 9)


def test_recipe_names_follow_the_configs() -> None:
    found = recipe_args.parse(["int8wo", INTX4, "Int8WeightOnlyConfig(granularity=PerGroup(128))",
                               "transformer=float8wo,text_encoder_2=int8wo"])
    assert found[0].name == "int8wo"
    assert found[1].name.startswith("intx-weight-only-") and len(found[1].name.rsplit("-", 1)[1]) == 8
    assert found[2].name.startswith("int8-weight-only-") and found[2].name != recipe_args.parse(["Int8WeightOnlyConfig()"])[0].name
    assert found[3].name.startswith("transformer-float8wo-text_encoder_2-int8wo-")
    assert found[3].title == "transformer: float8wo, text_encoder_2: int8wo" and found[3].tensor_class == ""
    assert found[3].tensor_classes == ("Float8Tensor", "Int8Tensor")
    # the same config given twice (or as its own recipe name) is one recipe; the name is stable
    again = recipe_args.parse([INTX4, "IntxWeightOnlyConfig(granularity=PerGroup(32), weight_dtype=torch.int4)", "intx4wo"])
    assert [r.name for r in again] == [found[1].name, "intx4wo"]
    # a command run elsewhere (HF Jobs) gets the configs as text: the same recipe comes back
    table = layers.parse_layer_arg('{"re:.*attn.*": "int8wo", "proj_out": null}', recipes.CALLS)
    mixed = recipe_args.recipe_for(spec.parse_quant([f"transformer={INTX4},text_encoder_2=int8wo"], recipes.CALLS)[0], [table])
    args = mixed.job_args()
    assert args[0] == "--quant" and args[2] == "--layer-config"
    back = recipe_args.parse([args[1]], [args[3]])[0]
    assert back.name == mixed.name and back.name.endswith(mixed.name[-8:]) and "-per-layer-" in back.name


# ---------------------------------------------------------------- per-layer tables

def test_layer_tables_and_the_libraries_rules() -> None:
    body = json.dumps({"re:.*attn.*": "int8wo", "proj_out": None, "x": INTX4})
    table = layers.parse_layer_arg(f"transformer={body}", recipes.CALLS)
    assert table.component == "transformer" and [k for k, _ in table.entries] == ["re:.*attn.*", "proj_out", "x"]
    config = layers.fqn_table(syntax.parse("Float8WeightOnlyConfig()").config, table)
    assert list(config.fqn_to_config) == ["re:.*attn.*", "proj_out", "x", "_default"]
    entries = {"a.weight": 1, "a": 2, "re:a.*": 3, "re:.*weight": 4, "_default": 5}
    assert adapters.of("diffusers").resolve(entries, "a.weight")[0] == 1
    assert adapters.of("diffusers").resolve({"a": 2, "_default": 5}, "a.weight")[0] == 2
    # diffusers tries every pattern on the parameter first; transformers each pattern on the parameter then the module
    patterns = {"re:b": 3, "re:.*weight": 4}
    assert adapters.of("diffusers").resolve(patterns, "b.weight")[0] == 4
    assert adapters.of("transformers").resolve(patterns, "b.weight")[0] == 3
    assert adapters.of("diffusers").resolve({"c": 1}, "b.weight") == (None, "no entry and no _default")
    for bad, said in (('{"_default": "int8wo"}', "drop _default"), ('{"re:(": null}', "not a valid regular expression"),
                      ('{"a": 3}', "is not a config"), ("[]", "JSON object"), ('{"a": null, "a": null}', "appears twice"),
                      ('{"a": "FqnToConfig({})"}', "cannot itself be a per-layer table")):
        with pytest.raises(UsageError, match=said):
            layers.parse_layer_arg(bad, recipes.CALLS)


def test_a_missing_layer_table_file_is_named_with_what_the_option_takes(tmp_path: Path) -> None:
    """Not --quant's "give a recipe name, a config call or a JSON file": --layer-config takes neither of the first two."""
    takes = "--layer-config takes a JSON file, or a JSON object inline"
    for check in (layers.precheck_layer_arg, layers.parse_layer_arg):
        with pytest.raises(UsageError, match=rf"^--layer-config '{tmp_path}/layers.json': no such file: "
                                             rf"{tmp_path}/layers.json; {takes}"):
            check(str(tmp_path / "layers.json"), recipes.CALLS)
        with pytest.raises(UsageError, match=rf"^--layer-config transformer= '{tmp_path}': is a folder, not a file: "
                                             rf"{tmp_path}; {takes}"):
            check(f"transformer={tmp_path}", recipes.CALLS)


def _component(library: str = "diffusers", biased: bool = False) -> Any:
    linears = ("blocks.0.attn.to_q", "blocks.0.attn.to_k", "blocks.0.ff.proj", "proj_out")
    params = [f"{n}.weight" for n in linears] + ["blocks.0.norm.weight"] + ([f"{n}.bias" for n in linears] if biased else [])
    return SimpleNamespace(name="transformer" if library == "diffusers" else "", label="transformer", library=library,
                           class_name="Model", linear_names=linears, module_names=frozenset(linears) | {"blocks.0.norm"},
                           linear_shapes=tuple((n, 64, 96 if n == "proj_out" else 128) for n in linears),
                           param_names=tuple(params), default_skips=())


def test_the_plan_checks_each_table_and_each_layer_before_any_download() -> None:
    from publisher.stages import layercheck

    comp = _component()

    def recipe(quant: str, table: str | None = None) -> recipes.Recipe:
        bound = recipe_args.parse([quant], [table] if table else [])[0]
        return layercheck.bind(bound, [comp])

    layercheck.check(recipe("int8wo", '{"re:.*attn.*": "float8wo", "proj_out": null}'), [comp], [])
    for table, said in (('{"re:.*nothing.*": null}', "matches no Linear layer"),
                        ('{"blocks.0.norm": null}', "is not a Linear layer"),
                        ('{"blocks.0.attn.to_v": null}', "names no module"),
                        ('{"re:.*": "float8wo", "re:.*attn.*": null}', "applies to no layer"),
                        ('{"re:blocks\\\\.0\\\\.attn\\\\.to_k.*": "float8wo", "re:.*attn.*": null}', "sorted keys")):
        with pytest.raises(UsageError, match=said):
            layercheck.check(recipe("int8wo", table), [comp], [])
    # a group size that does not divide a layer's in_features: named before anything is read, with the fix
    with pytest.raises(UsageError, match=r"layer proj_out of transformer \(in_features 96\) cannot be quantized with its "
                                         r"config: torchao says AssertionError: .*--exclude proj_out"):
        layercheck.check(recipe("IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(64))"), [comp], [])
    layercheck.check(recipe("IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(64))"), [comp], ["proj_out"])
    layercheck.check(recipe("IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(64))", '{"proj_out": null}'),
                     [comp], [])
    # transformers: the biases of matched Linear layers are guarded, and a pattern reaching a norm is refused
    lm = _component("transformers", biased=True)
    bound = layercheck.bind(recipe_args.parse(["int8wo"], ['{"blocks.0.attn.to_q": "float8wo"}'])[0], [lm])
    assert bound.layers[0].guards == (layercheck.BIAS_GUARD, "blocks.0.attn.to_q.bias")
    assert list(bound.config_for("").fqn_to_config)[:2] == [layercheck.BIAS_GUARD, "blocks.0.attn.to_q.bias"]
    layercheck.check(bound, [lm], [])
    with pytest.raises(UsageError, match="also matches blocks.0.norm.weight, which transformers would then quantize"):
        layercheck.check(layercheck.bind(recipe_args.parse(["int8wo"], ['{"re:blocks\\\\.0\\\\..*": "float8wo"}'])[0], [lm]),
                         [lm], [])
    with pytest.raises(UsageError, match="names no component and 2 are quantized"):
        layercheck.bind(recipe_args.parse(["int8wo"], ['{"proj_out": null}'])[0], [comp, lm])


# ---------------------------------------------------------------- the card's Python

def test_the_card_python_builds_the_pipeline_quantization_config() -> None:
    from publisher.stages import card_config

    comps = [SimpleNamespace(name="transformer", label="transformer", library="diffusers", class_name="FluxTransformer2DModel"),
             SimpleNamespace(name="text_encoder_2", label="text_encoder_2", library="transformers", class_name="T5EncoderModel")]
    table = layers.parse_layer_arg('transformer={"re:.*attn.*": "float8wo", "proj_out": null}', recipes.CALLS)
    recipe = recipe_args.recipe_for(spec.parse_quant([f"transformer={INTX4},text_encoder_2=int8wo"], recipes.CALLS)[0], [table])
    code = card_config.python(recipe, comps, "pipeline", "bfl/base", {"text_encoder_2": {"modules_to_not_convert": ["shared"]}})
    assert "PipelineQuantizationConfig(quant_mapping={" in code and "TransformersTorchAoConfig(text_encoder_2_config, " \
        "modules_to_not_convert=[\"shared\"])" in code and "quant_backend" not in code
    namespace: dict[str, Any] = {}
    exec(code, namespace)  # noqa: S102 - what the card prints, run as a user pastes it
    mapping = namespace["quantization_config"].quant_mapping
    assert type(mapping["transformer"]).__module__.startswith("diffusers")
    assert type(mapping["text_encoder_2"]).__module__.startswith("transformers")
    assert render.canonical(mapping["transformer"].quant_type) == render.canonical(recipe.config_for("transformer"))
    assert render.canonical(mapping["text_encoder_2"].quant_type) == render.canonical(recipe.config_for("text_encoder_2"))
    lm = [SimpleNamespace(name="", label="model", library="transformers", class_name="LlamaForCausalLM")]
    code = card_config.python(recipe_args.parse([INTX4])[0], lm, "transformers", "meta/llama", {})
    exec(code, namespace)  # noqa: S102
    assert "AutoModelForCausalLM" in code and render.canonical(namespace["quantization_config"].quant_type) == \
        render.canonical(syntax.parse(INTX4).config)


def test_facts_say_how_the_values_are_stored() -> None:
    intx = facts_for(syntax.parse(INTX4).config)
    assert intx.tensor_class == "IntxUnpackedToInt8Tensor" and intx.bits == 8.75 and intx.probed
    assert "int4 values stored unpacked, one per int8 byte" in intx.storage
    int8 = facts_for(syntax.parse("Int8WeightOnlyConfig(granularity=PerGroup(128))").config)
    assert int8.tensor_class == "Int8Tensor" and 8 < int8.bits < 8.5


def test_one_device_rule_serves_quantizing_and_running() -> None:
    """recipes.device picks one device for both steps, which holds while every device rule asks the same of each."""
    from publisher.configs.facts import INT4_RULES, RULES

    for name, rule in {**RULES, **INT4_RULES}.items():
        assert rule.quantize == rule.run, name
    fp8, int8 = recipes.get("float8dq"), recipes.get("int8wo")
    assert [recipes.device(fp8, cc) for cc in (None, (8, 0), (8, 9))] == ["cpu", "cpu", "cuda"]
    assert recipes.device(int8, (9, 0)) == "cpu"


def test_jobs_flavors_follow_the_configs() -> None:
    from publisher.flavors import BUILTIN
    from publisher.hfjobs import jobchecks

    mixed = recipe_args.parse(["transformer=float8dq,text_encoder_2=intx4wo"])[0]  # the most demanding config decides
    assert [f.name for f in jobchecks.fitting(mixed, BUILTIN)] == ["l4x1", "l40sx1"]
    assert jobchecks.check_flavor([mixed], "l4x1", BUILTIN).name == "l4x1"
    tile = recipe_args.parse(['Int4WeightOnlyConfig(int4_packing_format="tile_packed_to_4d")'])[0]
    with pytest.raises(UsageError, match="needs a CUDA GPU with compute capability >= 8.0 to quantize and cpu-basic has no GPU"):
        jobchecks.check_flavor([tile], "cpu-basic", BUILTIN)
    assert jobchecks.check_flavor([recipes.get("int8dq-int4")], "cpu-basic", BUILTIN).name == "cpu-basic"
