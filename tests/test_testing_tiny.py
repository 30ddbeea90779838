"""The tiny offline test models: complete Hub-like folders, byte-for-byte deterministic, and runnable."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from publisher.testing import tiny

# Self-tests of the test infrastructure: in the full run, not in `make test-fast`.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

FLUX_FILES = {
    ".gitattributes",
    "LICENSE.md",
    "README.md",
    "flux1-tiny.safetensors",
    "model_index.json",
    "scheduler/scheduler_config.json",
    "text_encoder/config.json",
    "text_encoder/model.safetensors",
    "text_encoder_2/config.json",
    "text_encoder_2/model.safetensors",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
    "tokenizer_2/tokenizer.json",
    "tokenizer_2/tokenizer_config.json",
    "transformer/config.json",
    "transformer/diffusion_pytorch_model.safetensors",
    "vae/config.json",
    "vae/diffusion_pytorch_model.safetensors",
}
LLAMA_FILES = {
    ".gitattributes",
    "README.md",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}


def _hashes(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _front_matter(readme: Path) -> dict:
    from huggingface_hub import metadata_load

    return metadata_load(readme) or {}


def _linear_shapes(module) -> set[tuple[int, int]]:
    import torch

    return {(m.in_features, m.out_features) for m in module.modules() if isinstance(m, torch.nn.Linear)}


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build_tiny_flux(tmp_path_factory.mktemp("flux") / "repo")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build_tiny_llama(tmp_path_factory.mktemp("llama") / "repo")


def test_import_is_lazy() -> None:
    code = "import sys, publisher.testing.tiny; print(sorted({'torch', 'diffusers', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_flux_files_and_card(flux_dir: Path) -> None:
    assert set(_hashes(flux_dir)) == FLUX_FILES
    index = json.loads((flux_dir / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline"
    assert index["transformer"] == ["diffusers", "FluxTransformer2DModel"]
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"]
    assert index["text_encoder_2"] == ["transformers", "T5EncoderModel"]
    assert index["tokenizer"][1] == "CLIPTokenizer" and index["tokenizer_2"][1] == "T5Tokenizer"
    meta = _front_matter(flux_dir / "README.md")
    assert meta["license"] == "other"
    assert meta["license_name"] == "flux-1-dev-non-commercial-license"
    assert meta["license_link"] == "LICENSE.md"
    assert meta["pipeline_tag"] == "text-to-image"
    assert meta["library_name"] == "diffusers"
    assert meta["tags"] == ["text-to-image", "image-generation", "flux"]
    assert "*.safetensors filter=lfs" in (flux_dir / ".gitattributes").read_text()


def test_flux_weights_bf16_and_dims(flux_dir: Path) -> None:
    import torch
    from safetensors import safe_open

    for rel in ("transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors",
                "text_encoder_2/model.safetensors", "vae/diffusion_pytorch_model.safetensors"):
        with safe_open(flux_dir / rel, "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}, rel
    with safe_open(flux_dir / "flux1-tiny.safetensors", "pt") as root, safe_open(
        flux_dir / "transformer/diffusion_pytorch_model.safetensors", "pt"
    ) as sub:
        assert set(root.keys()) == set(sub.keys())

    from diffusers import FluxTransformer2DModel

    transformer = FluxTransformer2DModel.from_pretrained(flux_dir / "transformer", torch_dtype=torch.bfloat16)
    shapes = _linear_shapes(transformer)
    # Every Linear takes a multiple of 128 inputs, so PerGroup(32/64/128) configs apply everywhere.
    assert {i for i, _ in shapes} == {128, 256, 512, 640}


def test_flux_without_license(tmp_path: Path) -> None:
    folder = tiny.build_tiny_flux(tmp_path, license=None)
    assert not (folder / "LICENSE.md").exists()
    meta = _front_matter(folder / "README.md")
    assert not {"license", "license_name", "license_link"} & set(meta)
    assert meta["library_name"] == "diffusers"


def test_flux_is_deterministic(flux_dir: Path, tmp_path: Path) -> None:
    again = tiny.build_tiny_flux(tmp_path / "again")
    assert _hashes(again) == _hashes(flux_dir)
    other = _hashes(tiny.build_tiny_flux(tmp_path / "seed1", seed=1))
    assert other["transformer/diffusion_pytorch_model.safetensors"] != _hashes(flux_dir)[
        "transformer/diffusion_pytorch_model.safetensors"
    ]


def test_flux_pipeline_runs(flux_dir: Path) -> None:
    import torch
    from diffusers import DiffusionPipeline, FluxPipeline

    pipe = FluxPipeline.from_pretrained(flux_dir, torch_dtype=torch.bfloat16)
    out = pipe(
        prompt="a cat",
        num_inference_steps=2,
        height=64,
        width=64,
        guidance_scale=3.5,
        generator=torch.Generator().manual_seed(0),
        max_sequence_length=32,
        output_type="np",
    )
    image = out.images[0]
    assert image.shape == (64, 64, 3)
    assert not (image != image).any()  # no NaN
    # Any prompt tokenizes without error, including non-ASCII text.
    assert pipe.tokenizer("Ünïcode prompt!").input_ids[-1] == pipe.tokenizer.eos_token_id
    assert pipe.tokenizer_2("a cat").input_ids[-1] == pipe.tokenizer_2.eos_token_id

    generic = DiffusionPipeline.from_pretrained(flux_dir)
    assert type(generic).__name__ == "FluxPipeline"


def test_llama_files_and_generate(llama_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert set(_hashes(llama_dir)) == LLAMA_FILES
    meta = _front_matter(llama_dir / "README.md")
    assert (meta["license"], meta["pipeline_tag"], meta["library_name"]) == (
        "apache-2.0", "text-generation", "transformers"
    )
    assert json.loads((llama_dir / "config.json").read_text())["dtype"] == "bfloat16"

    tok = AutoTokenizer.from_pretrained(llama_dir)
    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    assert model.dtype == torch.bfloat16
    assert len(tok) == model.config.vocab_size
    inputs = tok("hello world", return_tensors="pt")
    assert inputs.input_ids[0, 0].item() == tok.bos_token_id
    out = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == inputs.input_ids.shape[1] + 5 or out[0, -1].item() == tok.eos_token_id
    assert tok.decode(tok("héllo wörld").input_ids, skip_special_tokens=True) == "héllo wörld"
    shapes = _linear_shapes(model)
    assert {i for i, _ in shapes} == {128, 256}


def test_llama_is_deterministic_across_processes(llama_dir: Path, tmp_path: Path) -> None:
    # Also exercises the command-line entry, in a process with a different hash seed.
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, "-m", "publisher.testing.tiny", "llama", str(tmp_path / "cli")],
        cwd=ROOT, env=env, check=True, capture_output=True,
    )
    assert _hashes(tmp_path / "cli") == _hashes(llama_dir)


def test_not_a_model(tmp_path: Path) -> None:
    folder = tiny.build_not_a_model(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "data.csv"]


def test_remote_code_model(tmp_path: Path) -> None:
    folder = tiny.build_remote_code_model(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_x.XForCausalLM"
    assert (folder / "modeling_x.py").is_file()
