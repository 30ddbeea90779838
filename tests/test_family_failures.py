"""Each failure mode issue 15 found, as its own test: the top-level parameter on the manual path, SDXL's
added_cond_kwargs, transformers' MoE key conversion on the manual path, GPT-2's zero quantized layers, "weights
only" wording, and the repo id of a local --no-push run. The corpus (tests/test_families.py) runs every family end
to end, and asserts there the quality figures of float32 bases and the video snippet in a fresh interpreter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import IN_PROCESS, SKIP_EVAL_AND_MATRIX

SMALL = ["--sample-steps", "2", "--sample-size", "64"]


def test_manual_path_reads_a_top_level_parameter(tmp_path: Path) -> None:
    """torchao's unflatten helper splits every name on its last dot: ``scale_shift_table`` (no dot) broke it."""
    import torch
    from safetensors.torch import save_file
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from publisher.loadpath import read_checkpoint

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale_shift_table = torch.nn.Parameter(torch.randn(2, 64))
            self.proj = torch.nn.Linear(64, 64)

    model = Model().to(torch.bfloat16)
    quantize_(model, Int8WeightOnlyConfig())
    tensors, metadata = flatten_tensor_state_dict(model.state_dict())
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata=metadata)
    state = read_checkpoint(tmp_path)
    assert set(state) == {"scale_shift_table", "proj.weight", "proj.bias"}
    assert torch.equal(state["scale_shift_table"], model.scale_shift_table.detach())
    assert type(state["proj.weight"]).__name__ == "Int8Tensor"


def test_sdxl_call_is_recorded_with_added_cond_kwargs(tmp_path: Path) -> None:
    """The UNet of SDXL needs text_embeds and time_ids: the recorded pipeline call carries them."""
    from publisher.loadpath import load_call
    from publisher.testing.families import build_family
    from publisher.verify.capture import for_components

    base = build_family("sdxl", tmp_path / "sdxl")
    found = for_components(base, "StableDiffusionXLPipeline", {"unet": ("diffusers", "UNet2DConditionModel")}, tmp_path / "w")
    assert found["unet"].file is not None, found["unet"].reason
    call = load_call(found["unet"].file)
    assert set(call["added_cond_kwargs"]) == {"text_embeds", "time_ids"}
    assert call["sample"].dtype == call["encoder_hidden_states"].dtype == __import__("torch").bfloat16
    assert "StableDiffusionXLPipeline" in found["unet"].how


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_manual_path_merges_moe_experts_like_transformers(tmp_path: Path, family: str) -> None:
    """transformers 5 fuses per-expert checkpoint tensors into one parameter at load: the manual path does the
    same with the model's own conversion rules, bit for bit."""
    import torch
    import transformers

    from publisher.loadpath import convert_checkpoint_keys, load_into, meta_model, read_checkpoint
    from publisher.testing.families import build_family

    base = build_family(family, tmp_path / family)
    config = transformers.AutoConfig.from_pretrained(base)
    cls = config.architectures[0]
    manual = load_into(meta_model("transformers", cls, config), convert_checkpoint_keys(meta_model("transformers", cls, config),
                                                                                          read_checkpoint(base))).eval()
    library = getattr(transformers, cls).from_pretrained(base, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(manual(ids).logits, library(ids).logits)


def test_gpt2_with_no_quantizable_layer_is_refused(cli: Any, tmp_path: Path) -> None:
    """GPT-2's matmuls are Conv1D: int8wo quantizes nothing. That is an error naming the layer types, exit 1,
    and nothing is left behind."""
    from publisher.testing.families import build_family

    base = build_family("gpt2", tmp_path / "gpt2")
    out = tmp_path / "out"
    result = cli(str(base), "--quant", "int8wo", "--no-push", "--output-dir", str(out), *SMALL, *SKIP_EVAL_AND_MATRIX)
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.stderr
    assert ("Error: model (GPT2LMHeadModel): no layer was quantized with int8wo; it holds 1 nn.Linear layers and "
            "8 Conv1D layers, 2 embeddings, 1 Linear kept by the library's rules") in errors[0]
    assert "--allow-unquantized" in errors[0] and "nothing was pushed" in errors[0]
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.slow
def test_weights_only_is_said_and_nothing_else_claimed(cli: Any, tiny_flux_dir: Path, tmp_path: Path) -> None:
    """FLUX's VAE is used through decode(), never forward(): its outputs cannot be compared. The card and --json
    say "weights only" and why, and claim no compared outputs or quality figures for it."""
    out = tmp_path / "out"
    result = cli(str(tiny_flux_dir), "--quant", "int8wo", "--components", "transformer,vae", "--no-push",
                 "--output-dir", str(out), "--json", *SMALL, *SKIP_EVAL_AND_MATRIX)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    forward = data["verification"]["forward"]
    assert forward["vae"]["weights_only"] and "does not call vae's forward" in forward["vae"]["reason"]
    assert not forward["transformer"]["weights_only"] and "FluxPipeline" in forward["transformer"]["inputs"]
    for r in data["verification"]["results"]:
        assert r["ok"] and r["forward_checked"] is (r["component"] == "transformer")
        assert (r["max_abs_diff"] is None) is (r["component"] == "vae")
    assert [q["component"] for q in data["quality"]] == ["transformer"]
    card = (out / "README.md").read_text()
    assert "- `vae`: **weights only**, no outputs compared: the FluxPipeline run does not call vae's forward" in card
    assert "- `transformer`: the call FluxPipeline makes at 32x32 px, 1 step, seeded" in card
    assert "compared bit for bit with the in-memory quantized model on fixed, seeded inputs" not in card
    assert "| vae |" in card.split("### Quality")[0] and "| vae |" not in card.split("### Quality")[1].split("##")[0]


@pytest.mark.slow
def test_local_base_without_push_uses_the_token_users_repo_id(cli: Any, hub: Any, tiny_llama_dir: Path, tmp_path: Path) -> None:
    """With a token, a --no-push run of a local folder shows the repo id a push would use (whoami)."""
    out = tmp_path / "out"
    result = cli(str(tiny_llama_dir), "--quant", "int8wo", "--no-push", "--output-dir", str(out), "--json", *SMALL,
                 *IN_PROCESS, *SKIP_EVAL_AND_MATRIX, token="tok_alice")  # the repo id is the subject, not the reloads
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["repo_id"] == "alice/tiny-llama-torchao-int8wo" and data["repo_id_note"] is None
    card = (out / "README.md").read_text()
    assert 'AutoModelForCausalLM.from_pretrained("alice/tiny-llama-torchao-int8wo"' in card
    assert "none was chosen" not in card and "your-username" not in card
