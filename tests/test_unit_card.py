"""The model card from fixture data (tests/unit_fixtures.py): no quantization, no reload, no push.

What a user relies on in a card: the metadata the Hub indexes, the sections, the exact config as stored and the Python
that builds it, the hardware rows, snippets that load the target repo, and a verification table that shows each
load's outcome as it was. tests/test_stages_card.py checks the same cards end to end (a real publish, golden files,
every snippet run).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import unit_fixtures as uf

SECTIONS = ("## Summary", "## What was quantized", "## The exact torchao config", "## Hardware requirements", "## Quality",
            "## Software requirements", "## Compatibility", "## How to use", "## Verification", "## How it was made",
            "## Intended use and limitations")
HARDWARE_ROW = ("| `Int8WeightOnlyConfig()` | {where} | `Int8Tensor` | int8 values plus scales: about 8.04 bits per weight "
                "(measured on a 256x1024 Linear) | CPU or any GPU | any CUDA GPU (memory-bound layers); runs on CPU | "
                "CPU or any GPU |")


@pytest.fixture(scope="module", autouse=True)
def _libraries() -> None:
    """torch, torchao and the libraries whose classes the card names, imported once (seconds) before the first test:
    the tests measure the card, not the imports."""
    import diffusers
    import torchao  # noqa: F401
    import transformers  # noqa: F401

    assert diffusers.FluxPipeline  # a lazy import: the pipeline's module and what it imports


def _render(plan: Any, artifacts: Any, report: Any, target: str | None, **inputs: Any) -> str:
    from publisher.stages.card import CardInputs, render

    return render(plan, artifacts, report, target, CardInputs(command=inputs.pop("command", "hf-ao-publish x"), **inputs))


def _snippets(text: str, lang: str = "python") -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _metadata(text: str) -> dict[str, Any]:
    from huggingface_hub import ModelCard

    return ModelCard(text).data.to_dict()


def _section(text: str, heading: str) -> str:
    return text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def test_lm_card_from_fixture_data(tmp_path: Path) -> None:
    plan, artifacts = uf.lm_publish(tmp_path / "repo")
    report = uf.report_for(artifacts, uf.passing_results(artifacts))
    text = _render(plan, artifacts, report, "alice/unit-llama",
                   command="hf-ao-publish meta/tiny-llama --quant int8wo --repo-id alice/unit-llama")
    data = _metadata(text)
    assert data["base_model"] == "meta/tiny-llama" and data["base_model_relation"] == "quantized"
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert data["tags"] == ["torchao", "int8wo", "hf-ao-publish", "quantized", "llama", "tiny"]
    assert data["license"] == "apache-2.0" and "license_link" not in data
    assert [s for s in SECTIONS if s not in text] == []
    assert text.split("\n---\n", 1)[1].lstrip().startswith("# tiny-llama (torchao int8wo)")
    assert f"[meta/tiny-llama](https://hub.invalid/meta/tiny-llama) at commit `{uf.SHA}`" in text
    assert "| model | `LlamaForCausalLM` | 6 of 7 (Int8Tensor: 6) | 1 embeddings, 1 Linear kept by the library's rules |" in text
    # the size row says what the percentage is of, and the class names read with their article
    assert "| size | 787.71 KB of bf16 weights -> **513.74 KB** (65% of the bf16 size); the whole repo: " in text
    # the repo's files: the weights and everything else apart (a card's comparison image, configs, tokenizers)
    files = artifacts.files()
    weights = sum(v for k, v in files.items() if k.endswith(".safetensors"))
    got = re.search(r"the whole repo: ([\d.]+) (K?B) \(weights of every component ([\d.]+) (K?B); configs, tokenizers, "
                    r"card: ([\d.]+) (K?B)\) \|", text)
    assert got is not None, text.split("| size |")[1][:300]
    total, weight, rest = (float(got[i]) * (1000 if got[i + 1] == "KB" else 1) for i in (1, 3, 5))
    assert weight == pytest.approx(weights, abs=10) and rest == pytest.approx(sum(files.values()) - weights, abs=10)
    assert total == pytest.approx(sum(files.values()), abs=10)
    assert "every quantized layer an `Int8Tensor`" in text and "a `Int8Tensor`" not in text
    # the config exactly as stored in config.json, and the Python that builds it
    (stored,) = _snippets(text, "json")
    assert json.loads(stored) == uf.INT8WO_STORED["quant_type"]
    config, use, compiled, manual = _snippets(text)
    assert config.startswith("import torch\nfrom torchao.quantization import Int8WeightOnlyConfig\n"
                             "from transformers import AutoModelForCausalLM, TorchAoConfig\n")
    assert "\nconfig = Int8WeightOnlyConfig()\nquantization_config = TorchAoConfig(config)\n" in config
    assert config.rstrip().endswith('# AutoModelForCausalLM.from_pretrained("meta/tiny-llama", '
                                    'quantization_config=quantization_config, dtype=torch.bfloat16)')
    for code in (config, use, compiled, manual):
        compile(code, "<card snippet>", "exec")  # valid Python as printed (test_stages_card.py runs them)
    # every snippet loads the target repo
    assert 'AutoModelForCausalLM.from_pretrained("alice/unit-llama", dtype=torch.bfloat16)' in use and "model.generate(" in use
    assert 'AutoTokenizer.from_pretrained("alice/unit-llama")' in compiled and "torch.compile(model.forward)" in compiled
    assert 'folder = Path(snapshot_download("alice/unit-llama"))' in manual and "convert_checkpoint_keys(model" in manual
    assert HARDWARE_ROW.format(where="model: 6 layers") in _section(text, "## Hardware requirements")
    assert "| to run | CPU or any GPU |" in text and "| extra kernel packages | none |" in text
    assert "Result: **passed**" in text
    assert ("| model | library | current (torch 2.13.0+cpu, torchao 0.18.0, diffusers 0.42.1, transformers 5.23.0) "
            "| pass | 6 | 0 |") in text
    assert "```bash\nhf-ao-publish meta/tiny-llama --quant int8wo --repo-id alice/unit-llama\n```" in text
    assert "Licence files copied from the base: `LICENSE`." in text
    assert "Total download: **522 B** (3 files)." in text  # config.json, model.safetensors, tokenizer.json


def test_pipeline_card_with_two_quantized_components(tmp_path: Path) -> None:
    plan, artifacts = uf.pipeline_publish(tmp_path / "repo")
    report = uf.report_for(artifacts, uf.passing_results(artifacts))
    text = _render(plan, artifacts, report, "alice/unit-flux", sample={"prompt": "a red fox", "steps": 28, "size": 1024})
    data = _metadata(text)
    assert data["base_model"] == "bfl/tiny-flux" and data["base_model_relation"] == "quantized"
    assert data["library_name"] == "diffusers" and data["pipeline_tag"] == "text-to-image"
    assert {"torchao", "int8wo", "hf-ao-publish", "quantized", "flux"} == set(data["tags"])
    assert data["license"] == "other" and data["license_name"] == "flux-1-dev-non-commercial-license"
    assert data["license_link"] == f"https://hub.invalid/bfl/tiny-flux/blob/{uf.SHA}/LICENSE.md"  # made absolute
    assert [s for s in SECTIONS if s not in text] == []
    assert "| transformer | `FluxTransformer2DModel` | 4 of 4 (Int8Tensor: 4) | norms and small parameters only |" in text
    assert "| text_encoder_2 | `T5EncoderModel` | 2 of 2 (Int8Tensor: 2) |" in text
    assert "Kept as they were in the base: `vae` (AutoencoderKL)." in text
    # each quantized component's stored config, named
    assert "As stored in each quantized component's `config.json`" in text
    assert "`transformer`:\n\n```json\n" in text and "`text_encoder_2`:\n\n```json\n" in text
    assert [json.loads(s) for s in _snippets(text, "json")] == [uf.INT8WO_STORED["quant_type"]] * 2
    config, use, offload, compiled, manual = _snippets(text)
    assert "from diffusers import DiffusionPipeline, PipelineQuantizationConfig, TorchAoConfig\n" in config
    assert "from transformers import TorchAoConfig as TransformersTorchAoConfig\n" in config
    assert ('quantization_config = PipelineQuantizationConfig(quant_mapping={\n    "transformer": TorchAoConfig(config),\n'
            '    "text_encoder_2": TransformersTorchAoConfig(config),\n})') in config
    for code in (config, use, offload, compiled, manual):
        compile(code, "<card snippet>", "exec")
    for code in (use, offload, compiled):
        assert 'DiffusionPipeline.from_pretrained("alice/unit-flux", dtype=torch.bfloat16)' in code
        assert 'prompt="a red fox"' in code
    assert "pipe.enable_model_cpu_offload()" in offload and "pipe.transformer = torch.compile(pipe.transformer)" in compiled
    assert "size, steps = (1024, 28) if device == \"cuda\" else (256, 4)" in use  # a GPU's size, a CPU's smaller one
    assert ('folder = Path(snapshot_download("alice/unit-flux", allow_patterns=["transformer/*"])) / "transformer"'
            in manual) and "from diffusers import FluxTransformer2DModel" in manual
    hardware = _section(text, "## Hardware requirements")
    assert HARDWARE_ROW.format(where="transformer: 4 layers; text_encoder_2: 2 layers") in hardware
    assert "| weight memory | transformer: 1.12 MB (bf16: 2.11 MB); text_encoder_2: 229.40 KB (bf16: 433.98 KB) |" in hardware
    # loading a pipeline without torchvision, transformers warns about each image processor it has: both are named
    assert "`CLIPImageProcessor requires torchvision` and `SiglipImageProcessor requires torchvision`" in text


def test_verification_table_shows_each_outcome(tmp_path: Path) -> None:
    """pass, fail, silently wrong and not applicable, each shown as such; the card of a failed verification says so."""
    from publisher.errors import VerificationError
    from publisher.handoffs.report import require_passed

    plan, artifacts = uf.pipeline_publish(tmp_path / "repo")
    wrong = "loads without an error, but 1 of 2 planned layers are of the class their config implies"
    results = [
        uf.result("transformer", "library", layers=4),
        uf.result("transformer", "manual", "not applicable", layers=0, detail="it has no manual load path"),
        uf.result("text_encoder_2", "library", "fail", layers=0, detail="RuntimeError: mat1 and mat2 shapes"),
        uf.result("text_encoder_2", "manual", "silently wrong", layers=1, detail=wrong),
    ]
    report = uf.report_for(artifacts, results)
    assert not report.passed and [r.outcome for r in report.failures()] == ["fail", "silently wrong"]
    text = _render(plan, artifacts, report, "alice/unit-flux")
    env = "current (torch 2.13.0+cpu, torchao 0.18.0, diffusers 0.42.1, transformers 5.23.0)"
    rows = [line for line in _section(text, "## Verification").splitlines() if line.startswith("| ") and " | " + env in line]
    assert rows == [
        f"| transformer | library | {env} | pass | 4 | 0 |",
        f"| transformer | manual | {env} | not applicable: it has no manual load path | 0 | weights only |",
        f"| text_encoder_2 | library | {env} | FAIL: RuntimeError: mat1 and mat2 shapes | 0 | weights only |",
        f"| text_encoder_2 | manual | {env} | FAIL: {wrong} | 1 | weights only |",
    ]
    assert "Result: **FAILED**" in text and "Result: **passed**" not in text
    compat = _section(text, "## Compatibility")
    assert "> **Silently wrong:** with this tool's own environment" in compat
    assert "text_encoder_2 loaded through the manual path raises no error, but 1 of 2 planned layers" in compat
    assert "| fail: RuntimeError: mat1 and mat2 shapes | **SILENTLY WRONG**: " + wrong + " |" in compat
    # the manual snippet is for the first component, whose manual path does not apply
    assert "This load path does not apply to `transformer` (FluxTransformer2DModel): it has no manual load path." in text
    with pytest.raises(VerificationError, match=r"text_encoder_2 via the library path \(current\): RuntimeError: mat1"):
        require_passed(report)


def test_write_cards_writes_the_card_and_the_report(tmp_path: Path) -> None:
    """write_cards writes README.md and verification.json for a failed verification too (push is what refuses)."""
    from publisher.stages.card import Built, CardSettings, write_cards

    plan, artifacts = uf.lm_publish(tmp_path / "repo")
    results = uf.passing_results(artifacts)
    results[1] = uf.result("", "manual", "silently wrong", detail="loads without an error, but tensor lm_head.weight differs")
    report = uf.report_for(artifacts, results)
    written = write_cards(plan, {"int8wo": Built(artifacts, report)},
                          CardSettings("hf-ao-publish meta/tiny-llama", {"steps": 28, "size": 1024}, "https://hub.invalid"))
    assert written == [tmp_path / "repo" / "README.md", tmp_path / "repo" / "verification.json"]
    card = written[0].read_text()
    assert "Result: **FAILED**" in card and "FAIL: loads without an error, but tensor lm_head.weight differs" in card
    assert 'tokenizer("The capital of France is"' in card  # a language model's default prompt
    assert "weights produced on CPU" in card
    saved = json.loads(written[1].read_text())
    assert saved["passed"] is False and [r["outcome"] for r in saved["results"]] == ["pass", "silently wrong"]


def test_card_without_a_target_loads_the_folder(tmp_path: Path) -> None:
    plan, artifacts = uf.lm_publish(tmp_path / "repo", target=None)
    report = uf.report_for(artifacts, uf.passing_results(artifacts))
    text = _render(plan, artifacts, report, None, command="hf-ao-publish meta/tiny-llama --no-push")
    folder = str(tmp_path / "repo")
    assert "> **Repo id:** none was chosen" in text
    _, use, _, manual = _snippets(text)
    assert f'AutoModelForCausalLM.from_pretrained("{folder}", dtype=torch.bfloat16)' in use
    assert f'folder = Path("{folder}")\n' in manual and "snapshot_download(" not in manual.split("def load_into")[1]


def test_a_local_base_is_named_by_its_folder_never_its_path(tmp_path: Path) -> None:
    """A base given as a local folder: the card and the state file name it by the folder's own name; where it sat on
    this machine (a home folder, a user name) is in neither."""
    from dataclasses import replace

    from publisher.handoffs.plan import Source
    from publisher.state import state_for

    plan, artifacts = uf.lm_publish(tmp_path / "repo")
    where = tmp_path / "home" / "alice" / "models" / "my-llama"
    plan = replace(plan, source=Source(str(where), None, where, None, None, sizes=plan.source.sizes,
                                       card_data=plan.source.card_data))
    text = _render(plan, artifacts, uf.report_for(artifacts, uf.passing_results(artifacts)), "alice/unit-llama")
    assert str(tmp_path) not in text
    assert text.split("\n---\n", 1)[1].lstrip().startswith("# my-llama (torchao int8wo)")
    assert "quantization of the local model folder `my-llama`, made and verified" in text
    assert '# AutoModelForCausalLM.from_pretrained("my-llama", quantization_config=quantization_config' in text
    state = state_for(plan, artifacts.recipe)
    assert state["base_model"] == "my-llama" and str(tmp_path) not in json.dumps(state)
    moved = replace(plan, source=replace(plan.source, model_id="/elsewhere/my-llama", local_dir=Path("/elsewhere/my-llama")))
    assert state_for(moved, artifacts.recipe)["fingerprint"] == state["fingerprint"]  # moved, not changed: up to date


@pytest.mark.parametrize("targets", [{"int8wo": None, "float8wo": None},
                                     {"int8wo": "alice/v-int8wo", "float8wo": "alice/v-float8wo"}])
def test_sibling_variants_link_only_to_chosen_repos(tmp_path: Path, targets: dict[str, str | None]) -> None:
    """Two recipes: each card lists the other. Without a repo id (--no-push, no token) there is nothing to link to, so
    the table says so instead of an empty link."""
    from dataclasses import replace

    from publisher import recipes
    from publisher.stages.card import Built, CardSettings, write_cards

    done = {}
    for name in targets:
        plan, artifacts = uf.lm_publish(tmp_path / name)
        artifacts.recipe = recipes.get(name)
        done[name] = Built(artifacts, uf.report_for(artifacts, uf.passing_results(artifacts)))
    plan = replace(plan, recipes=tuple(recipes.get(n) for n in targets), targets=targets)
    write_cards(plan, done, CardSettings("hf-ao-publish meta/tiny-llama", {"steps": 28, "size": 1024}, "https://hub.invalid"))
    card = (tmp_path / "int8wo" / "README.md").read_text()
    rows = [line for line in _section(card, "## Other variants of this base").splitlines() if line.startswith("| ")][1:]
    assert "]()" not in card
    if targets["int8wo"] is None:
        assert rows[0].startswith("| int8wo | this repo | ") and rows[1].startswith("| float8wo | not published (no repo id "
                                                                                     "was chosen) | ")
    else:
        assert rows[0].startswith("| int8wo | [alice/v-int8wo](https://hub.invalid/alice/v-int8wo) (this repo) | ")
        assert rows[1].startswith("| float8wo | [alice/v-float8wo](https://hub.invalid/alice/v-float8wo) | ")


def test_a_report_without_a_passing_result_cannot_be_pushed(tmp_path: Path) -> None:
    from publisher.errors import VerificationError
    from publisher.handoffs.report import VerifyReport, require_passed

    with pytest.raises(VerificationError, match=r"verification of int8wo failed: 0 load checks passed; nothing was pushed"):
        require_passed(VerifyReport("int8wo", "repo", passed=False))
    _, artifacts = uf.lm_publish(tmp_path / "repo")
    report = uf.report_for(artifacts, [uf.result("", "library", "silently wrong", detail="loads without an error, but x")])
    with pytest.raises(VerificationError, match=r"model via the library path \(current\): silently wrong: loads without"):
        require_passed(report)
    require_passed(uf.report_for(artifacts, uf.passing_results(artifacts)))  # a passed report goes through


@pytest.mark.parametrize(("recipe", "workaround"), [("int8wo", True), ("int8dq", True), ("float8wo", False),
                                                    ("intx4wo", False)])
def test_the_cpu_compile_workaround_only_where_the_recipe_makes_int8tensor_weights(tmp_path: Path, recipe: str,
                                                                                    workaround: bool) -> None:
    """inductor's pattern matcher is a process-wide switch: the compile snippet turns it off on a CPU only for the
    recipes whose weights are Int8Tensor (torch 2.13's _weight_int8pack_mm crash), and leaves every other card alone."""
    from dataclasses import replace

    from publisher import recipes

    for plan, artifacts in (uf.lm_publish(tmp_path / "lm"), uf.pipeline_publish(tmp_path / "pipe")):
        artifacts.recipe = recipes.get(recipe)
        plan = replace(plan, recipes=(artifacts.recipe,))
        text = _render(plan, artifacts, uf.report_for(artifacts, uf.passing_results(artifacts)), "alice/x")
        (compiled,) = [code for code in _snippets(text) if "torch.compile(" in code]
        assert ("torch._inductor.config.pattern_matcher = False" in compiled) is workaround, compiled
        assert ("import torch._inductor.config" in compiled) is workaround
