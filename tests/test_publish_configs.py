"""Configs beyond the named recipes, published for real to the loopback Hub: torchao's call syntax, a config_to_dict
JSON file, a per-component mapping and a per-layer file. Each repo reloads with the libraries' own loaders, holds the
tensor class each layer's config makes, and its card shows the config exactly as given with the Python that builds
it (run here as a user pastes it). The GPU-only int4 config of the guide's table is refused before anything exists."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from helpers import IN_PROCESS, SKIP_EVAL_AND_MATRIX

SMALL = ["--sample-steps", "2", "--sample-size", "64"]
CALLS = ["Int8WeightOnlyConfig(granularity=PerGroup(128))", "Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())"]


def _card(repo_id: str) -> str:
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo_id, "README.md")).read_text()


def _config_snippet(card: str) -> dict[str, Any]:
    """Run the card's "Python that builds it" block; returns its namespace."""
    code = next(s for s in re.findall(r"```python\n(.*?)```", card, flags=re.S) if "quantization_config = " in s)
    namespace: dict[str, Any] = {}
    exec(compile(code, "<card config>", "exec"), namespace)  # noqa: S102 - the published card's own snippet
    return namespace


def _classes(model: Any) -> dict[str, str]:
    import torch

    return {n: type(m.weight).__name__ for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


@pytest.mark.slow
def test_call_syntax_and_json_configs_publish_and_reload(cli: Any, llama_repo: str, tmp_path: Path) -> None:
    import torch
    from torchao.core.config import config_to_dict
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig
    from transformers import AutoModelForCausalLM

    from publisher.configs.render import canonical

    config_file = tmp_path / "int8dq.json"
    config_file.write_text(json.dumps(config_to_dict(Int8DynamicActivationInt8WeightConfig()), indent=2))
    args = [llama_repo, "--quant", CALLS[0], "--quant", CALLS[1], "--quant", str(config_file),
            "--quant", "int8dq-int4", "--repo-id", "alice/cfg-{recipe}", "--json", *SMALL,
            *IN_PROCESS, *SKIP_EVAL_AND_MATRIX]  # reloaded below with from_pretrained; the fresh-process reloads: test_verify_full
    result = cli(*args, token="tok_alice")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["verified"] and len(data["results"]) == 4
    names = [r["recipe"] for r in data["results"]]
    assert names[0].startswith("int8-weight-only-") and names[2].startswith("int8-dynamic-activation-int8-weight-")
    assert names[3] == "int8dq-int4"  # a CPU int4 recipe, pushed like the rest
    wanted = {0: "Int8Tensor", 1: "Float8Tensor", 2: "Int8Tensor", 3: "IntxUnpackedToInt8Tensor"}
    for i, outcome in enumerate(data["results"]):
        repo = outcome["repo_id"]
        assert outcome["pushed"] and repo == f"alice/cfg-{names[i]}"
        # the library loader reloads it unchanged: every planned Linear of the class its config makes
        model = AutoModelForCausalLM.from_pretrained(repo, dtype=torch.bfloat16)
        classes = _classes(model)
        assert classes.pop("lm_head") == "Parameter" and set(classes.values()) == {wanted[i]}
        card = _card(repo)
        stored = json.loads(Path(_file(repo, "config.json")).read_text())
        quant_type = stored["quantization_config"]["quant_type"]["default"]
        assert canonical(_config_snippet(card)["quantization_config"].quant_type) == json.dumps(quant_type, sort_keys=True)
        if i < 2:  # the call exactly as given
            assert f"Given as `--quant '{CALLS[i]}'`." in card and f"config = {CALLS[i]}\n" in card
        elif i == 3:  # the recipe: its config in call syntax, and honest about the storage
            assert "Int8DynamicActivationIntxWeightConfig(" in card and "int4 values stored unpacked, one per int8 byte" in card
        else:  # the JSON file: its name as given, and the call syntax that builds the same config
            assert f"Given as `--quant {config_file}`." in card and "config = Int8DynamicActivationInt8WeightConfig()\n" in card
    fp8 = _card(data["results"][1]["repo_id"])
    assert "| to run | CUDA GPU with compute capability >= 8.9 |" in fp8 and "hf-ao-publish makes it on a CPU too" in fp8
    assert "weights produced on CPU" in fp8


@pytest.mark.slow
def test_a_per_component_mapping_with_a_per_layer_file_publishes_one_repo(cli: Any, flux_repo: str, tmp_path: Path) -> None:
    import torch
    from diffusers import DiffusionPipeline

    from publisher.configs.render import canonical

    table = tmp_path / "layers.json"
    table.write_text('{\n  "re:single_transformer_blocks\\\\..*": "float8wo",\n  "proj_out": null\n}\n')
    quant = "transformer=intx4wo,text_encoder_2=int8wo"
    result = cli(flux_repo, "--quant", quant, "--layer-config", f"transformer={table}", "--repo-id", "alice/flux-mixed",
                 "--json", *SMALL, *SKIP_EVAL_AND_MATRIX, token="tok_alice")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["pushed"] and data["verified"] and data["recipe"].startswith("transformer-intx4wo-text_encoder_2-int8wo-per-layer-")
    layers = {c["name"]: c for c in data["components"]}
    assert layers["transformer"]["tensor_classes"]["Float8Tensor"] > 0 and layers["transformer"]["excluded_layers"] == 1
    assert set(layers["text_encoder_2"]["tensor_classes"]) == {"Int8Tensor"}
    pipe = DiffusionPipeline.from_pretrained("alice/flux-mixed", dtype=torch.bfloat16)
    classes = _classes(pipe.transformer)
    assert classes.pop("proj_out") == "Parameter"  # null in the file: left alone
    assert {c for n, c in classes.items() if n.startswith("single_transformer_blocks.")} == {"Float8Tensor"}
    assert {c for n, c in classes.items() if not n.startswith("single_transformer_blocks.")} == {"IntxUnpackedToInt8Tensor"}
    assert set(_classes(pipe.text_encoder_2).values()) == {"Int8Tensor"}
    assert set(_classes(pipe.text_encoder).values()) == {"Parameter"}  # not in the mapping: kept as it was
    card = _card("alice/flux-mixed")
    assert f"Given as `--quant {quant}`, with `--layer-config` for `transformer` (`layers.json`)." in card
    assert table.read_text().strip() in card  # the file exactly as given
    assert "PipelineQuantizationConfig(quant_mapping={" in card and "TransformersTorchAoConfig(text_encoder_2_config)" in card
    mapping = _config_snippet(card)["quantization_config"].quant_mapping
    for name in ("transformer", "text_encoder_2"):  # the card's Python builds exactly what config.json stores
        stored = json.loads(Path(_file("alice/flux-mixed", f"{name}/config.json")).read_text())["quantization_config"]
        assert canonical(mapping[name].quant_type) == json.dumps(stored["quant_type"]["default"], sort_keys=True)
    stored = json.loads(Path(_file("alice/flux-mixed", "transformer/config.json")).read_text())
    assert set(stored["quantization_config"]["quant_type"]["default"]["_data"]["fqn_to_config"]) == {
        "re:single_transformer_blocks\\..*", "proj_out", "_default"}  # stored with sorted keys (layercheck: order-free)
    assert "int4 values stored unpacked, one per int8 byte" in card and "| `Float8WeightOnlyConfig()` | transformer: " in card
    state = json.loads(Path(_file("alice/flux-mixed", "hf_ao_publish.json")).read_text())
    assert state["quant"]["given"] == quant and state["quant"]["layers"][0]["component"] == "transformer"


def _file(repo: str, name: str) -> str:
    from huggingface_hub import hf_hub_download

    return hf_hub_download(repo, name)


def test_the_gpu_int4_config_is_refused_on_a_cpu_before_anything_is_made(cli: Any, llama_repo: str) -> None:
    from huggingface_hub import HfApi

    result = cli(llama_repo, "--quant", "Int4WeightOnlyConfig()", "--repo-id", "alice/never-int4", token="tok_alice")
    assert result.exit_code == 1
    assert "needs a CUDA GPU and mslk to quantize, and this machine has none" in result.stderr
    assert "Traceback" not in result.output and not HfApi().repo_exists("alice/never-int4")
